"""Model FLOPs per token and the peak FLOP/s they are divided by (MFU).

Counts matmul FLOPs only (2 per multiply-add): norms, RoPE, softmax and the optimizer
are left out, as in PaLM's MFU. Unlike MaxText's count, every MTP depth contributes
its `eh_proj`, its block **and** its vocab projection (the shared OutHead is applied
once per depth). A training token costs 3x the forward pass (backward = 2x forward);
rematerialisation is not counted (this is MFU, not hardware FLOPs utilisation).

Attention scores and values are counted causally: query i attends i + 1 keys, so a
sequence of T tokens averages (T + 1) / 2 keys per query (what a causal kernel has to
compute; `causal=False` counts the full T x T as PaLM's appendix does).

The peak: the vendor table on GPU/TPU; on CPU the best matmul probe ever taken on this
machine, cached on disk (`cpu_peak`), never the probe of the current (possibly loaded)
moment.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import platform
import time

import jax
import jax.numpy as jnp

from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import mla
from mtp_jax.model import moe
from mtp_jax.model.mtp import ModelArgs, block_classes


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
  """Forward FLOPs per token by part; `train` = 3 x `forward`."""
  trunk_matmul: float  # L blocks: q, k, v, o projections and the SwiGLU MLP
  trunk_attention: float  # L blocks: scores (q k^T) and weighted values
  mtp_eh_proj: float  # D sequential depths: M_k, 2d -> d
  mtp_block: float  # D depths: their block's projections, MLP and attention
  vocab: float  # (D + 1) OutHead projections: the main head and one per depth

  @property
  def forward(self) -> float:
    return (self.trunk_matmul + self.trunk_attention + self.mtp_eh_proj + self.mtp_block
            + self.vocab)

  @property
  def train(self) -> float:
    return 3.0 * self.forward

  def train_frozen_trunk(self, depth: int) -> float:
    """model.mtp.freeze_trunk: the trunk and the main head run forward only; the MTP
    eh_proj and blocks 3x; the D MTP vocab projections 2x (input gradient, frozen OutHead)."""
    mtp_vocab = self.vocab * depth / (depth + 1)
    return self.forward + 2.0 * (self.mtp_eh_proj + self.mtp_block) + mtp_vocab

  def as_dict(self) -> dict:
    return {'trunk_matmul': self.trunk_matmul, 'trunk_attention': self.trunk_attention,
            'mtp_eh_proj': self.mtp_eh_proj, 'mtp_block': self.mtp_block, 'vocab': self.vocab,
            'forward': self.forward, 'train': self.train}


def block_flops(d: int, n_heads: int, n_kv_heads: int, head_dim: int, mlp_dim: int,
                seq_len: int, causal: bool = True) -> tuple[float, float]:
  """(projection + MLP, attention) forward FLOPs per token of one decoder block."""
  q = 2 * d * n_heads * head_dim
  kv = 2 * 2 * d * n_kv_heads * head_dim
  o = 2 * n_heads * head_dim * d
  mlp = 3 * 2 * d * mlp_dim  # gate, up, down
  keys = (seq_len + 1) / 2 if causal else seq_len
  attn = 2 * 2 * n_heads * head_dim * keys  # q k^T and p v, per query head
  return float(q + kv + o + mlp), float(attn)


def layer_flops(args, layer: int, seq_len: int, causal: bool = True) -> tuple[float, float]:
  """block_flops of trunk layer `layer` (n_layers: the MTP block) by its kinds.

  MLA: the q (latent or direct), kv_a, kv_b and o projections, scores over dn + dr and
  values over dv. MoE: only the active experts (router, K routed + the shared SwiGLUs),
  the FLOPs a token actually costs, not the parameters it could reach.
  """
  attn_cls, mlp_cls = block_classes(args, layer)
  d, n = args.d_model, args.n_heads
  proj, attn = block_flops(d, n, args.n_kv_heads, args.head_dim, args.mlp_dim, seq_len, causal)
  keys = (seq_len + 1) / 2 if causal else seq_len
  if attn_cls is mla.MLAttention:
    qr, kvr = args.q_lora_rank, args.kv_lora_rank
    dn, dr, dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    q = 2 * d * qr + 2 * qr * n * (dn + dr) if qr else 2 * d * n * (dn + dr)
    kv = 2 * d * (kvr + dr) + 2 * kvr * n * (dn + dv)
    proj = proj - 2 * d * n * args.head_dim * 2 - 2 * 2 * d * args.n_kv_heads * args.head_dim
    proj += q + kv + 2 * n * dv * d
    attn = 2 * n * (dn + dr) * keys + 2 * n * dv * keys
  if mlp_cls is moe.MoE:
    f = args.moe_intermediate_size
    proj = proj - 3 * 2 * d * args.mlp_dim + 2 * d * args.n_routed_experts
    proj += 3 * 2 * d * f * (args.num_experts_per_tok + args.n_shared_experts)
  return float(proj), float(attn)


def flops_per_token(args, seq_len: int, causal: bool = True) -> FlopsPerToken:
  """FLOPs per token of `args` (a model.ModelArgs) on sequences of seq_len tokens."""
  per_layer = [layer_flops(args, i, seq_len, causal) for i in range(args.n_layers + 1)]
  depth = args.mtp_depth
  eh = 2 * (2 * args.d_model) * args.d_model if args.mtp_kind == 'sequential' else 0
  return FlopsPerToken(
      trunk_matmul=sum(p for p, _ in per_layer[:-1]),
      trunk_attention=sum(a for _, a in per_layer[:-1]),
      mtp_eh_proj=float(depth * eh),
      mtp_block=depth * sum(per_layer[-1]),
      vocab=float((depth + 1) * 2 * args.d_model * args.vocab_size))


def config_flops_per_token(config, causal: bool = True) -> FlopsPerToken:
  args = ModelArgs.from_config(config, tokenizers.model_vocab_size(config))
  return flops_per_token(args, config.data.seq_len, causal)


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
# later probes (benchmarks/train_throughput.py, `python -m mtp_jax.train.flops`) only raise it.
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
                '`python -m mtp_jax.train.flops` when it is quiet, or set ' + PEAK_ENV)
  return peak['flops'] * processes, f'{where} x {processes} process(es)'


class MFU:
  """perf/mfu of a run: model FLOPs per token x tokens/s over the job's peak FLOP/s."""

  def __init__(self, config, devices=None):
    per_token = config_flops_per_token(config)
    self.flops_per_token = (per_token.train_frozen_trunk(config.model.mtp.depth)
                            if config_lib.optional(config, 'model.mtp.freeze_trunk', False)
                            else per_token.train)
    self.peak, self.source = peak_flops(jnp.dtype(config.model.dtype), devices)

  def metrics(self, tokens_per_sec: float) -> dict:
    return {'perf/mfu': self.flops_per_token * tokens_per_sec / self.peak}

  def describe(self) -> str:
    return (f'MFU counts {self.flops_per_token / 1e6:.1f} MFLOP per training token against '
            f'{self.peak / 1e12:.3g} TFLOP/s ({self.source}).')


def main():
  """`python -m mtp_jax.train.flops`: probe this CPU now, raise the cached peak if higher, print it."""
  peak = update_cpu_peak()
  print(f'{machine_key(jnp.float32)}: {peak["flops"] / 1e9:.1f} GFLOP/s (best of '
        f'{peak.get("probes_taken", 1)} probe runs; best taken {peak["date"]}, load average '
        f'{peak["load_average"]}) in {_peak_file()}')


if __name__ == '__main__':
  main()
