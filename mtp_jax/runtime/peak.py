"""The peak FLOP/s a run's MFU divides by.

Accelerators: the vendors' per-chip table. CPU: the best matmul probe ever taken on this
machine, cached on disk (`cpu_peak`), never the probe of the current (possibly loaded)
moment. `python -m mtp_jax.runtime.peak` probes now and raises the cache if higher.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import time

import jax
import jax.numpy as jnp

import mtp_jax.runtime.machine as machine

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


@functools.cache
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
# later probes (each run's quick one, benchmarks/train_throughput.py, `python -m
# mtp_jax.runtime.peak`) and a run's own achieved FLOP/s only raise it.
CACHE_DIR_ENV = 'MTP_JAX_CACHE_DIR'  # default: $XDG_CACHE_HOME/mtp_jax or ~/.cache/mtp_jax
PEAK_ENV = 'MTP_JAX_CPU_PEAK_FLOPS'  # a number (FLOP/s per process) overrides the cache
PROBE_SIZES = ((2048, 5), (4096, 2))  # (n, repeats) per probe round


def cache_dir() -> str:
  if os.environ.get(CACHE_DIR_ENV):
    return os.environ[CACHE_DIR_ENV]
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'mtp_jax')


def machine_key(dtype) -> str:
  """What a cached peak is valid for: CPU model, usable cores, matmul dtype."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return f'{machine.cpu_model()} | {cores} cores | {jnp.dtype(dtype).name}'


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
  return {'flops': best, 'best_by_size': sizes, 'date': _now(),
          'load_average': [round(load0[0], 2), round(os.getloadavg()[0], 2)],  # start, end
          'jax': jax.__version__}


def update_cpu_peak(dtype=jnp.float32, rounds: int = 3, measured: dict | None = None) -> dict:
  """Probes now (or takes `measured`, a probe_cpu_peak-style dict of a probe taken
  elsewhere, e.g. a benchmark's own rounds or a run's achieved FLOP/s) and keeps the
  higher of it and the cached one (returns that).

  A lower reading taken on a quiet machine confirms a cached peak that was taken under
  load (`confirmed`), so it is no longer reported as loaded."""
  key = machine_key(dtype)
  new = measured if measured is not None else probe_cpu_peak(dtype, rounds)
  peaks = _read_peaks()
  old = peaks.get(key)
  if old is None or new['flops'] > old['flops']:
    new['probes_taken'] = (old or {}).get('probes_taken', 0) + 1
    if old is not None:
      new['replaced'] = {k: old.get(k) for k in ('flops', 'date', 'load_average')}
    peaks[key] = new
  else:
    old['probes_taken'] = old.get('probes_taken', 1) + 1
    if _is_loaded(old) and not _is_loaded(new):
      old['confirmed'] = {k: new.get(k) for k in ('flops', 'date', 'load_average')}
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


def _cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1


def _is_loaded(record: dict) -> bool:
  """Taken while other work kept more than half the cores busy (1-minute load average)."""
  load = record.get('load_average')
  return bool(load) and max(load) > 0.5 * _cores() and not record.get('confirmed')


def peak_flops(dtype=jnp.float32, devices=None) -> tuple[float, str]:
  """(peak FLOP/s of the whole job, where the number came from), without probing now.

  Accelerators: the table's per-chip peak x the number of chips (a chip the table
  lacks: an 8192^2 probe). CPU: this machine's cached best probe (`cpu_peak`) x the
  number of processes. Runs use `job_peak`, which also checks the cache against a probe.
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
  return peak['flops'] * processes, f'{where} x {processes} process(es)'


# -- the peak a run divides by, checked against what the run itself measures ---------------
# A run takes a quick probe at start (a 1024^2 matmul, a few hundredths of a second): one
# above the cache raises it, and one well above (the cache was taken under load) triggers
# a full probe. While it trains, a run whose own model FLOP/s beat the peak raises it
# again (`Peak.check`), so MFU never exceeds 1.
QUICK_PROBE = (1024, 3)  # (n, repeats)
FULL_PROBE_ABOVE = 1.25  # a quick probe this far above the cache re-probes in full


@dataclasses.dataclass
class Peak:
  """The peak FLOP/s of a job: `per_unit` (a chip, or a CPU process) x `units`."""
  per_unit: float
  units: int
  kind: str  # 'table', 'probe' (an accelerator the table lacks), 'cpu cache', 'env'
  date: str | None = None
  load_average: list | None = None
  note: str = ''  # what changed it in this run, for the console
  loaded: bool = False  # a CPU peak taken under load, never confirmed on a quiet machine
  told: bool = False  # `check` has said once that achieved FLOP/s beat it

  @property
  def flops(self) -> float:
    return self.per_unit * self.units

  def line(self) -> str:
    """'peak: 196.3 GFLOP/s for MFU (best f32 matmul probe here, 2026-12-03 11:40, load 0.9)'."""
    where = {'table': 'data sheet', 'probe': 'matmul probe now',
             'env': f'${PEAK_ENV}'}.get(self.kind, 'best f32 matmul probe here')
    if self.units > 1:
      unit = 'chip' if self.kind in ('table', 'probe') else 'process'
      where = f'{_fmt_flops(self.per_unit)} per {unit} x {self.units}, {where}'
    if self.date:
      where += f', {self.date.replace("T", " ")[:16]}'
    if self.load_average:
      where += f', load {max(self.load_average):.1f}'
    text = f'peak: {_fmt_flops(self.flops)} for MFU ({where})'
    if self.note:
      text += f'; {self.note}'
    if self.loaded:
      text += '; taken under load, so MFU may read high'
    return text

  def as_metrics(self) -> dict:
    """perf/peak_* fields for metrics.jsonl (perf/peak_flops is also a TensorBoard scalar)."""
    out = {'perf/peak_flops': float(self.flops), 'perf/peak_source': self.kind}
    if self.date:
      out['perf/peak_date'] = self.date
    if self.load_average:
      out['perf/peak_load_average'] = float(max(self.load_average))
    return out

  def check(self, achieved: float, notify=None, source: str = 'this run') -> float:
    """MFU (<= 1) of `achieved` model FLOP/s of the whole job.

    Achieved FLOP/s above the peak prove the peak low: a CPU cache is raised to them
    (by process 0), an accelerator's or $MTP_JAX_CPU_PEAK_FLOPS's is only replaced for
    this run; `notify` hears of the first raise.
    """
    if achieved <= self.flops:
      return achieved / self.flops
    old = self.flops
    per_unit = achieved / self.units
    if self.kind == 'cpu cache' and jax.process_index() == 0:
      update_cpu_peak(measured={
          'flops': per_unit, 'date': _now(), 'load_average': _load(), 'jax': jax.__version__,
          'source': f'model FLOP/s achieved by {source}'})
    self.per_unit, self.date, self.load_average, self.loaded = per_unit, _now(), _load(), False
    self.note = f'raised from {_fmt_flops(old)} by the FLOP/s {source} achieved'
    if notify is not None and not self.told:
      self.told = True
      notify(f'peak: {source} ran at {_fmt_flops(achieved)}, above the peak of '
             f'{_fmt_flops(old)} it divided by; MFU now divides by that'
             + (' (cache raised)' if self.kind == 'cpu cache' else ''))
    return 1.0


def _fmt_flops(x: float) -> str:
  if x >= 1e15:
    return f'{x / 1e15:.3g} PFLOP/s'
  if x >= 1e12:
    return f'{x / 1e12:.3g} TFLOP/s'
  return f'{x / 1e9:.1f} GFLOP/s' if x >= 1e8 else f'{x:.3g} FLOP/s'


def _now() -> str:
  return datetime.datetime.now().isoformat(timespec='seconds')


def _load() -> list:
  return [round(os.getloadavg()[0], 2)]


def job_peak(dtype=jnp.float32, devices=None, probe: bool = True) -> Peak:
  """The peak a run's MFU divides by; CPU: the cache, checked against a quick probe now.

  probe: take the quick probe (a single-process CPU job; several processes on one host
  would only slow each other's). A probe above the cache raises it; one FULL_PROBE_ABOVE
  times above it (a cache taken under load) is followed by a full probe.
  """
  devices = jax.devices() if devices is None else devices
  units = len(devices)
  if devices[0].platform != 'cpu':
    flops, where = peak_flops(dtype, devices)
    return Peak(flops / units, units, 'table' if where.startswith('table') else 'probe')
  units = len({d.process_index for d in devices})
  if os.environ.get(PEAK_ENV):
    return Peak(float(os.environ[PEAK_ENV]), units, 'env')
  cached = _read_peaks().get(machine_key(jnp.float32))
  note = ''
  if cached is None:
    cached = update_cpu_peak(jnp.float32)
    note = 'first probe on this machine, cached'
  elif probe and jax.process_count() == 1:
    n, reps = QUICK_PROBE
    quick = matmul_probe(jax.local_devices()[0], n=n, dtype=jnp.float32, reps=reps)
    if quick > cached['flops']:
      old = cached['flops']
      if quick > FULL_PROBE_ABOVE * old:
        cached = update_cpu_peak(jnp.float32, rounds=1)
      cached = update_cpu_peak(jnp.float32, measured={
          'flops': quick, 'best_by_size': {str(n): quick}, 'date': _now(),
          'load_average': _load(), 'jax': jax.__version__, 'source': 'a run\'s quick probe'})
      note = f'raised from {_fmt_flops(old)} by this run\'s probe'
    elif _is_loaded(cached) and os.getloadavg()[0] < 0.5 * _cores():
      old = cached['flops']
      cached = update_cpu_peak(jnp.float32, rounds=1)  # quiet now: replace or confirm it
      if cached['flops'] > old:
        note = f'raised from {_fmt_flops(old)} (taken under load) by this run\'s probe'
  return Peak(cached['flops'], units, 'cpu cache', cached.get('date'),
              cached.get('load_average'), note, _is_loaded(cached))


def mfu(achieved: float, *, source: str, dtype=jnp.float32, devices=None,
        notify=None) -> tuple[float, Peak]:
  """(MFU <= 1, the Peak it divided by) of `achieved` model FLOP/s of a job on `devices`.

  What every figure called MFU divides by (benchmarks included): the same peak as a
  training run's, raised (with the cache) when `achieved` beats it. No probe is taken.
  """
  peak = job_peak(dtype, devices, probe=False)
  return peak.check(achieved, notify, source), peak


def main():
  """`python -m mtp_jax.runtime.peak`: probes this CPU now, raises the cached peak if higher."""
  peak = update_cpu_peak()
  print(f'{machine_key(jnp.float32)}: {peak["flops"] / 1e9:.1f} GFLOP/s (best of '
        f'{peak.get("probes_taken", 1)} probe runs; best taken {peak["date"]}, load average '
        f'{peak["load_average"]}) in {_peak_file()}')


if __name__ == '__main__':
  main()
