"""The peak FLOP/s a run's MFU divides by.

Accelerators: the vendors' per-chip table. CPU: the best matmul probe ever taken on this
machine in the run's compute dtype, cached on disk per dtype (`cpu_peak`), never the probe
of the current (possibly loaded) moment. A bfloat16 run divides by the bf16 peak (the
bf16 x bf16 -> f32 dot XLA:CPU runs on its bf16 kernels), a float32 (or float16) run by
the f32 one, and a run only ever raises its own dtype's peak. `python -m
mtp_jax.runtime.peak [--dtype bfloat16]` probes now and raises the cache if higher.
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
  # f32 in, f32 out: a plain f32 dot. bf16 in: the bf16-kernel form (f32 accumulation),
  # what model.matmul runs a bfloat16 model's products as on CPU.
  return jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))


def cpu_dtype(dtype) -> jnp.dtype:
  """The dtype whose CPU peak a run in compute `dtype` divides by: bfloat16 for bfloat16,
  float32 otherwise (XLA:CPU converts float16 dots to float32)."""
  return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


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
BF16_PEAK_ENV = 'MTP_JAX_CPU_BF16_PEAK_FLOPS'  # the same for bfloat16 runs


def peak_env(dtype) -> str:
  """The variable that overrides the cached CPU peak of compute `dtype`."""
  return BF16_PEAK_ENV if cpu_dtype(dtype) == jnp.bfloat16 else PEAK_ENV
PROBE_SIZES = ((2048, 5), (4096, 2))  # (n, repeats) per probe round


def cache_dir() -> str:
  if os.environ.get(CACHE_DIR_ENV):
    return os.environ[CACHE_DIR_ENV]
  base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(base, 'mtp_jax')


def machine_key(dtype) -> str:
  """What a cached peak is valid for: CPU model, usable cores, matmul dtype."""
  return f'{machine.cpu_model()} | {machine.usable_cores()} cores | {jnp.dtype(dtype).name}'


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
  env = peak_env(dtype)
  if os.environ.get(env):
    return {'flops': float(os.environ[env]), 'date': None, 'load_average': None,
            'source': env}
  cached = _read_peaks().get(machine_key(dtype))
  return cached if cached is not None else update_cpu_peak(dtype)


_cores = machine.usable_cores


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
  dt = cpu_dtype(dtype)
  peak = cpu_peak(dt)
  if peak.get('source') == peak_env(dt):
    where = peak['source']
  else:
    where = (f'cached best cpu {dt.name} matmul probe of {peak["date"]}, load average '
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
  dtype: str = 'float32'  # CPU: the compute dtype whose cached peak this is (cpu_dtype)

  @property
  def flops(self) -> float:
    return self.per_unit * self.units

  def line(self) -> str:
    """'peak: 196.3 GFLOP/s for MFU (best float32 matmul probe here, 2026-12-03 11:40,
    load 0.9)'."""
    where = {'table': 'data sheet', 'probe': 'matmul probe now',
             'env': f'${peak_env(self.dtype)}'}.get(self.kind,
                                                    f'best {self.dtype} matmul probe here')
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
    if self.kind in ('cpu cache', 'env'):
      out['perf/peak_dtype'] = self.dtype
    if self.date:
      out['perf/peak_date'] = self.date
    if self.load_average:
      out['perf/peak_load_average'] = float(max(self.load_average))
    return out

  def check(self, achieved: float, notify=None, source: str = 'this run') -> float:
    """MFU (<= 1) of `achieved` model FLOP/s of the whole job.

    Achieved FLOP/s above the peak prove the peak low: a CPU cache (this peak's dtype's
    only) is raised to them (by process 0), an accelerator's or $MTP_JAX_CPU_PEAK_FLOPS's is
    only replaced for this run; `notify` hears of the first raise.
    """
    if achieved <= self.flops:
      return achieved / self.flops
    old = self.flops
    per_unit = achieved / self.units
    if self.kind == 'cpu cache' and jax.process_index() == 0:
      update_cpu_peak(self.dtype, measured={
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
  dt = cpu_dtype(dtype)
  if os.environ.get(peak_env(dt)):
    return Peak(float(os.environ[peak_env(dt)]), units, 'env', dtype=dt.name)
  cached = _read_peaks().get(machine_key(dt))
  note = ''
  if cached is None:
    cached = update_cpu_peak(dt)
    note = 'first probe on this machine, cached'
  elif probe and jax.process_count() == 1:
    n, reps = QUICK_PROBE
    quick = matmul_probe(jax.local_devices()[0], n=n, dtype=dt, reps=reps)
    if quick > cached['flops']:
      old = cached['flops']
      if quick > FULL_PROBE_ABOVE * old:
        cached = update_cpu_peak(dt, rounds=1)
      cached = update_cpu_peak(dt, measured={
          'flops': quick, 'best_by_size': {str(n): quick}, 'date': _now(),
          'load_average': _load(), 'jax': jax.__version__, 'source': 'a run\'s quick probe'})
      note = f'raised from {_fmt_flops(old)} by this run\'s probe'
    elif _is_loaded(cached) and os.getloadavg()[0] < 0.5 * _cores():
      old = cached['flops']
      cached = update_cpu_peak(dt, rounds=1)  # quiet now: replace or confirm it
      if cached['flops'] > old:
        note = f'raised from {_fmt_flops(old)} (taken under load) by this run\'s probe'
  return Peak(cached['flops'], units, 'cpu cache', cached.get('date'),
              cached.get('load_average'), note, _is_loaded(cached), dtype=dt.name)


def mfu(achieved: float, *, source: str, dtype=jnp.float32, devices=None,
        notify=None) -> tuple[float, Peak]:
  """(MFU <= 1, the Peak it divided by) of `achieved` model FLOP/s of a job on `devices`.

  What every figure called MFU divides by (benchmarks included): the same peak as a
  training run's, raised (with the cache) when `achieved` beats it. No probe is taken.
  """
  peak = job_peak(dtype, devices, probe=False)
  return peak.check(achieved, notify, source), peak


# -- model.dtype = 'auto': bfloat16 where this CPU's bf16 dot is at least 2x its f32 dot ----
# A bf16 train step keeps some f32 work (norms, softmax, the optimizer, the converts around
# every dot), so a dot only a little faster in bf16 trains slower than f32: with AMX
# (5.4x the f32 dot) the step ran 1.45-2.1x f32, while AMD hosts whose bf16 dot is slower
# than f32 train slower in bf16. Accelerators: float32, the configs' explicit choice.
AUTO_BF16_AT = 2.0  # bf16 / f32 dot FLOP/s at or above which 'auto' picks bfloat16
AUTO_ENV = 'MTP_JAX_AUTO_DTYPE'  # float32 | bfloat16: what 'auto' resolves to, no probe
RATIO_PROBE = (1024, 3, 3)  # (n, repeats, interleaved rounds)


def ratio_file() -> str:
  return os.path.join(cache_dir(), 'cpu_bf16_ratio.json')


def bf16_speedup() -> dict:
  """{'ratio': bf16 / f32 FLOP/s of an n^2 dot, ...} for this CPU: a quick interleaved probe,
  taken once and cached per machine (the ratio holds under load, unlike either rate)."""
  key = machine_key(jnp.bfloat16).rsplit(' | ', 1)[0]
  try:
    with open(ratio_file()) as f:
      cached = json.load(f).get(key)
  except (OSError, ValueError):
    cached = None
  if cached is not None:
    return cached
  n, reps, rounds = RATIO_PROBE
  best = {'float32': 0.0, 'bfloat16': 0.0}
  for _ in range(rounds):
    for name in best:
      best[name] = max(best[name], matmul_probe(n=n, dtype=jnp.dtype(name), reps=reps))
  record = {'ratio': best['bfloat16'] / best['float32'], 'flops': best, 'n': n,
            'date': _now(), 'load_average': _load(), 'jax': jax.__version__}
  try:
    with open(ratio_file()) as f:
      table = json.load(f)
  except (OSError, ValueError):
    table = {}
  table[key] = record
  os.makedirs(cache_dir(), exist_ok=True)
  tmp = ratio_file() + f'.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    json.dump(table, f, indent=1)
  os.replace(tmp, ratio_file())
  return record


# What 'auto' means per job. Training: bfloat16 where it pays (above). Every job whose docs
# promise equality with float32 arithmetic elsewhere: float32. Decoding promises speculative
# output identical to plain decoding (greedy) and following the model's distribution
# (sampling), which bf16 rounding breaks at near ties (top-1 / top-2 margins of 1e-4 were
# seen to flip); a Hugging Face import promises the logits transformers computes.
JOBS = ('train', 'decode', 'interop')
EXACT_JOBS = ('decode', 'interop')


def compute_dtype(name: str, backend: str | None = None, job: str = 'train') -> jnp.dtype:
  """model.dtype as a dtype for `job` (JOBS). An explicit dtype is itself. 'auto': for
  training bfloat16 on a CPU whose bf16 dot runs at least AUTO_BF16_AT x its f32 dot
  (`bf16_speedup`; $MTP_JAX_AUTO_DTYPE pins it), else float32; for the exact jobs
  (EXACT_JOBS: decoding, Hugging Face imports) float32 everywhere."""
  if job not in JOBS:
    raise ValueError(f'unknown job {job!r} (one of {", ".join(JOBS)})')
  if name != 'auto':
    return jnp.dtype(name)
  if job in EXACT_JOBS:
    return jnp.dtype(jnp.float32)
  if os.environ.get(AUTO_ENV):
    return jnp.dtype(os.environ[AUTO_ENV])
  if (backend or jax.default_backend()) != 'cpu':
    return jnp.dtype(jnp.float32)
  fast = bf16_speedup()['ratio'] >= AUTO_BF16_AT
  return jnp.dtype(jnp.bfloat16 if fast else jnp.float32)


def resolve_model_dtype(config, job: str) -> str:
  """Sets config.model.dtype to what `job` computes in (compute_dtype of the dtype asked
  for) and config.model.dtype_requested to that request. Training asks for model.dtype as
  it stands (a config file's, or an override's); the exact jobs ask for what the saved run
  asked for (dtype_requested, when the config is a run's), so decoding a run trained under
  'auto' resolves 'auto' for decoding, not the training's bfloat16. Returns a line naming
  the resolved dtype and why."""
  m = config.model
  requested = m.dtype if job == 'train' else (m.get('dtype_requested') or m.dtype)
  dtype = compute_dtype(requested, job=job).name
  m.dtype_requested = requested
  m.dtype = dtype
  return dtype_line(config, job)


def dtype_line(config, job: str) -> str:
  """'Compute dtype: D (why).' of a config resolve_model_dtype resolved for `job`."""
  m = config.model
  why = {'train': 'for training on this host', 'decode': 'decoding: exact against plain '
         'decoding', 'interop': 'a Hugging Face import: exact against transformers'}[job]
  how = f'model.dtype=auto, {why}' if m.get('dtype_requested') == 'auto' else 'model.dtype'
  return f'Compute dtype: {m.dtype} ({how}).'


def main():
  """`python -m mtp_jax.runtime.peak`: probes this CPU now in float32 and bfloat16, raises
  each cached peak if higher."""
  for dt in (jnp.float32, jnp.bfloat16):
    peak = update_cpu_peak(dt)
    print(f'{machine_key(dt)}: {peak["flops"] / 1e9:.1f} GFLOP/s (best of '
          f'{peak.get("probes_taken", 1)} probe runs; best taken {peak["date"]}, load average '
          f'{peak["load_average"]}) in {_peak_file()}')
  ratio = bf16_speedup()
  print(f'bf16 / f32 dot: {ratio["ratio"]:.2f} ({ratio["date"]}); model.dtype=auto picks '
        f'{compute_dtype("auto", "cpu").name}')


if __name__ == '__main__':
  main()
