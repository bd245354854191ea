"""One process of a two-process CPU job (4 devices each, gloo) for test_multihost.py.

  python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR DATA_DIR STOP_AFTER [JSON]

JSON (optional): {"train": {field: value}, "kill_at": step, "sleep": {process: seconds}}:
config.train overrides; a SIGKILL of this process as step `kill_at`'s batch is drawn;
seconds this process sleeps before each step's batch (a slow host).
"""
import json
import os
import signal
import sys
import time


def main(process_id, num_processes, port, workdir, data_dir, stop_after, extra='{}'):
  from mtp_jax.runtime import distributed
  distributed.initialize('auto', f'127.0.0.1:{port}', int(num_processes), int(process_id),
                         cpu_devices=4)
  import jax

  from helpers import job_config  # tests/ is on sys.path: it is this script's folder
  from mtp_jax.train import train_and_evaluate
  assert jax.process_count() == int(num_processes) and jax.device_count() == 8
  print(distributed.describe(), flush=True)
  extra = json.loads(extra)
  config = job_config(data_dir)
  config.train.progress = False
  for k, v in extra.get('train', {}).items():
    config.train[k] = v
  kill_at, sleep = extra.get('kill_at'), float(extra.get('sleep', {}).get(str(process_id), 0))

  def hook(step, batch):
    if step == kill_at:
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(sleep)
    return batch

  train_and_evaluate(config, workdir, stop_after=int(stop_after) if int(stop_after) > 0 else None,
                     batch_hook=hook if kill_at or sleep else None)


if __name__ == '__main__':
  main(*sys.argv[1:])
