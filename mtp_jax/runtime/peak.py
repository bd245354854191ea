"""The peak FLOP/s a run's MFU divides by.

Accelerators: the vendors' per-chip table. CPU: the best matmul probe ever taken on this
machine, cached on disk (`cpu_peak`), never the probe of the current (possibly loaded)
moment. `python -m mtp_jax.runtime.peak` probes now and raises the cache if higher.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp


# -- peak FLOP/s -------------------------------------------------------------------------
# Dense peak per chip, FLOP/s, from the vendors' data sheets: (bfloat16, float32 matmuls).
# float32 on TPU runs the MXU at bf16 rate with default precision; on GPUs JAX's default
# float32 matmul precision uses TF32 tensor cores.
PEAK_FLOPS = {
    'TPU v4': (275e12, 275e12),
    'TPU v5 lite': (197e12, 197e12),  # v5e
    'TPU v5': (459e12, 459e12),  # v5p
    'TPU v5p': (459e12, 459e12),
    'TPU v6 lite': (918e12, 918e12),  # v6e Trillium
    'NVIDIA H100 80GB HBM3': (989e12, 494e12),
    'NVIDIA H100': (989e12, 494e12),
    'NVIDIA H200': (989e12, 494e12),
    'NVIDIA A100-SXM4-80GB': (312e12, 156e12),
    'NVIDIA A100-SXM4-40GB': (312e12, 156e12),
    'NVIDIA L4': (121e12, 60e12),
}


def table_peak(device_kind: str, dtype) -> float | None:
  """The table's per-chip peak for a device kind (longest matching prefix), or None."""
  is_bf16 = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  best = None
  for kind, peaks in PEAK_FLOPS.items():
    if device_kind == kind or device_kind.startswith(kind):
      if best is None or len(kind) > len(best[0]):
        best = (kind, peaks)
  if best is None:
    return None
  return best[1][0] if is_bf16 else best[1][1]


@functools.lru_cache(maxsize=None)
def _probe_fn():
  return jax.jit(lambda a, b: a @ b)


def matmul_probe(device=None, n: int = 2048, dtype=jnp.float32, reps: int = 5) -> float:
  """Measured FLOP/s of an n x n matmul on `device` (the best of `reps` runs).

  On CPU the result is the whole process's rate: XLA:CPU runs every (fake) device's
  matmuls on the same intra-op thread pool.
  """
  device = device or jax.local_devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  b = jax.device_put(jnp.ones((n, n), dtype), device)
  fn = _probe_fn()
  fn(a, b).block_until_ready()
  best = float('inf')
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(a, b).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


# -- the CPU's peak: the best probe ever taken on this machine, cached on disk -----------
# A probe taken while other jobs share the cores reads 2-4x low, and dividing by it
# inflates MFU by as much; so a run never divides by its own probe. The first run on a
# machine probes several times and caches the best (with the date and load average);
# later probes (benchmarks/train_throughput.py, `python -m mtp_jax.runtime.peak`) only raise it.
CACHE_DIR_ENV = 'MTP_JAX_CACHE_DIR'  # default: $XDG_CACHE_HOME/mtp_jax or ~/.cache/mtp_jax
PEAK_ENV = 'MTP_JAX_CPU_PEAK_FLOPS'  # a number (FLOP/s per process) overrides the cache
PROBE_SIZES = ((2048, 5), (4096, 2))  # (n, repeats) per probe round


def cache_dir() -> str:
  if os.environ.get(CACHE_DIR_ENV):
    return os.environ[CACHE_DIR_ENV]
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'mtp_jax')


def _cpu_model() -> str:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine_key(dtype) -> str:
  """What a cached peak is valid for: CPU model, usable cores, matmul dtype."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return f'{_cpu_model()} | {cores} cores | {jnp.dtype(dtype).name}'


def _peak_file() -> str:
  return os.path.join(cache_dir(), 'cpu_peak_flops.json')


def _read_peaks() -> dict:
  try:
    with open(_peak_file()) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def probe_cpu_peak(dtype=jnp.float32, rounds: int = 3) -> dict:
  """Best FLOP/s over `rounds` x PROBE_SIZES matmul probes, with the load average."""
  best, sizes = 0.0, {}
  load0 = os.getloadavg()
  for _ in range(rounds):
    for n, reps in PROBE_SIZES:
      f = matmul_probe(jax.local_devices()[0], n=n, dtype=dtype, reps=reps)
      sizes[str(n)] = max(sizes.get(str(n), 0.0), f)
      best = max(best, f)
  return {'flops': best, 'best_by_size': sizes, 'date': datetime.datetime.now().isoformat(
      timespec='seconds'), 'load_average': [round(load0[0], 2), round(os.getloadavg()[0], 2)],  # 1-min, start/end
          'jax': jax.__version__}


def update_cpu_peak(dtype=jnp.float32, rounds: int = 3, measured: dict | None = None) -> dict:
  """Probes now (or takes `measured`, a probe_cpu_peak-style dict of a probe taken
  elsewhere, e.g. a benchmark's own rounds) and keeps the higher of it and the cached
  one (returns that)."""
  key = machine_key(dtype)
  new = measured if measured is not None else probe_cpu_peak(dtype, rounds)
  peaks = _read_peaks()
  old = peaks.get(key)
  if old is None or new['flops'] > old['flops']:
    new['probes_taken'] = (old or {}).get('probes_taken', 0) + 1
    peaks[key] = new
  else:
    old['probes_taken'] = old.get('probes_taken', 1) + 1
  os.makedirs(cache_dir(), exist_ok=True)
  tmp = _peak_file() + f'.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    json.dump(peaks, f, indent=1)
  os.replace(tmp, _peak_file())  # atomic: concurrent runs never read half a file
  return peaks[key]


def cpu_peak(dtype=jnp.float32) -> dict:
  """This machine's cached CPU peak ({'flops', 'date', 'load_average', ...}); probes
  (and caches) only the first time, or takes MTP_JAX_CPU_PEAK_FLOPS when set."""
  if os.environ.get(PEAK_ENV):
    return {'flops': float(os.environ[PEAK_ENV]), 'date': None, 'load_average': None,
            'source': PEAK_ENV}
  cached = _read_peaks().get(machine_key(dtype))
  return cached if cached is not None else update_cpu_peak(dtype)


def peak_flops(dtype=jnp.float32, devices=None) -> tuple[float, str]:
  """(peak FLOP/s of the whole job, where the number came from).

  Accelerators: the table's per-chip peak x the number of chips (a chip the table
  lacks: an 8192^2 probe). CPU: this machine's cached best probe (`cpu_peak`) x the
  number of processes.
  """
  devices = jax.devices() if devices is None else devices
  kind = devices[0].device_kind
  if devices[0].platform != 'cpu':
    per_chip = table_peak(kind, dtype)
    if per_chip is not None:
      return per_chip * len(devices), f'table: {kind} x {len(devices)}'
    n, probe_dtype = 8192, jnp.bfloat16 if jnp.dtype(dtype).itemsize < 4 else dtype
    per_chip = matmul_probe(jax.local_devices()[0], n=n, dtype=probe_dtype)
    return per_chip * len(devices), f'probe: {kind} {n}^2 matmul x {len(devices)}'
  processes = len({d.process_index for d in devices})
  # float16/bfloat16 models on CPU: XLA:CPU upcasts, and its f32 matmul is the fast path.
  peak = cpu_peak(jnp.float32)
  if peak.get('source') == PEAK_ENV:
    where = f'{PEAK_ENV}'
  else:
    where = (f'cached best cpu f32 matmul probe of {peak["date"]}, load average '
             f'{peak["load_average"]}, {_peak_file()}')
    if max(peak['load_average']) > 0.5 * (os.cpu_count() or 1):
      where += ('; WARNING: taken on a loaded machine, so MFU reads high: rerun '
                '`python -m mtp_jax.runtime.peak` when it is quiet, or set ' + PEAK_ENV)
  return peak['flops'] * processes, f'{where} x {processes} process(es)'


def main():
  """`python -m mtp_jax.runtime.peak`: probe this CPU now, raise the cached peak if higher, print it."""
  peak = update_cpu_peak()
  print(f'{machine_key(jnp.float32)}: {peak["flops"] / 1e9:.1f} GFLOP/s (best of '
        f'{peak.get("probes_taken", 1)} probe runs; best taken {peak["date"]}, load average '
        f'{peak["load_average"]}) in {_peak_file()}')


if __name__ == '__main__':
  main()


if __name__ == '__main__':
  main()
