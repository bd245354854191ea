"""One process of test_multihost.py's two-process CPU job (4 devices each, gloo).

  python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR DATA_DIR STOP_AFTER
"""
import sys


def main(process_id, num_processes, port, workdir, data_dir, stop_after):
  from mtp_jax.runtime import distributed
  distributed.initialize('auto', f'127.0.0.1:{port}', int(num_processes), int(process_id),
                         cpu_devices=4)
  import jax

  from helpers import job_config  # tests/ is on sys.path: it is this script's folder
  from mtp_jax.train import train_and_evaluate
  assert jax.process_count() == int(num_processes) and jax.device_count() == 8
  print(distributed.describe(), flush=True)
  train_and_evaluate(job_config(data_dir), workdir,
                           stop_after=int(stop_after) if int(stop_after) > 0 else None)


if __name__ == '__main__':
  main(*sys.argv[1:])
