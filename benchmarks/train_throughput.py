"""Training throughput, MTP overhead, loss memory and compile time; one JSON out.

  python benchmarks/train_throughput.py --out benchmarks/train_throughput.json
  python benchmarks/train_throughput.py --only mfu,overhead --rounds 12

Sections (issues 4, 14):
  mfu       the configs/stdlib_mtp.py train step: steps/s, tokens/s and MFU against the
            machine's peak (flops.cpu_peak: the best probe ever taken here, cached on
            disk, raised by a probe at the start of this section if that one is higher);
            also the old per-round ratio to a probe taken in the same round
  maxtext   MaxText 0.2.5's CPU peer model (4 layers, d 256, 8 x 32 heads, MLP 704,
            V 1024, batch 16 x 256, float32) at D = 0, 1, 3, round robin: tokens/s
  ab        speed changes A/B in one process, round robin: --ab_set attention (default):
            model.attention_core xla vs blocked on the stdlib_mtp and the MaxText-shape
            models; --ab_set train_speed: TRAIN_SPEED_VARIANTS of the MaxText-shape step at
            --depths (issue 14's second pass: attention core and batched loss vs before;
            fifth pass: one_device,two_devices); --ab_set stdlib_devices: configs/stdlib_mtp.py
            on one CPU device and on two
  overhead  step time with D = 1, 2, 3 over D = 0 (same trunk), next to the FLOP ratio
  moe       configs/dsv3_mini.py (MLA + DeepSeekMoE, issue 13): tokens/s, MFU counting active
            parameters only, and the dispatch overhead against a dense control with the
            same active FLOPs (and with 4x the routed experts), round robin
  memory    peak temporary memory of the compiled step (XLA memory analysis) at vocab
            32k, T = 1024, D = 1 vs D = 4, under XLA:CPU's default scheduler and its
            memory-aware one
  compile   train-step compile time: configs/tiny.py, and a 12-layer model with and
            without layer scan (persistent compilation cache off)

--cpu_devices (default auto, the trainer's own rule: 2 CPU devices, data parallel, on a
2+ core host) sets the devices every timed step trains on; the memory rows stay on one.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mtp_jax.runtime import host_memory  # noqa: E402  (standard library only)
from mtp_jax.data import tokenizers

# The allocator setting scripts/train.py makes (--host_malloc), before JAX starts a thread.
HOST_MALLOC = host_memory.configure(host_memory.mode_from_argv(sys.argv)) if __name__ == '__main__' else None

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax.runtime import distributed  # noqa: E402
from mtp_jax.train import flops as flops_lib  # noqa: E402
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.model import layers  # noqa: E402
from mtp_jax.model import attention as attn_lib
from mtp_jax.train import loss as loss_lib  # noqa: E402
from mtp_jax.model import mtp as model_lib  # noqa: E402
from mtp_jax.runtime import sharding  # noqa: E402
from mtp_jax.train import steps as steps_lib  # noqa: E402
from mtp_jax.model.mtp import ModelArgs  # noqa: E402

jax.config.update('jax_enable_compilation_cache', False)  # compile times must be real


def load_config(name: str):
  spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def synthetic_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
  """Packed rows of random tokens: documents of random length, a little padding."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((batch, seq_len), np.int32)
  pos = np.zeros((batch, seq_len), np.int32)
  for r in range(batch):
    i, s, end = 0, 1, seq_len - int(rng.integers(0, 4))
    while i < end:
      n = min(int(rng.integers(seq_len // 8, seq_len)), end - i)
      seg[r, i:i + n], pos[r, i:i + n] = s, np.arange(n)
      i, s = i + n, s + 1
  tokens = np.where(seg > 0, rng.integers(1, min(vocab, 256), size=seg.shape), 0)
  return {'tokens': tokens.astype(np.int32), 'segment_ids': seg, 'positions': pos}


# CPU devices a Step trains on (data parallel): main() sets it from --cpu_devices, whose
# default 'auto' is the trainer's own rule (distributed.resolve_cpu_devices: 2 on a 2+ core
# CPU host), so the benchmark times what `scripts/train.py` runs.
STEP_DEVICES = 1


class Step:
  """One config's compiled train step on STEP_DEVICES devices (or `devices`), with its
  state and a batch."""

  def __init__(self, config, devices: int | None = None):
    t0 = time.perf_counter()
    self.devices = devices or STEP_DEVICES
    self.ts, self.state = steps_lib.setup(config, jax.devices()[:self.devices])
    self.config = config
    args = ModelArgs.from_config(tokenizers.resolve_vocab_size(config))
    b, t = config.data.batch_size, config.data.seq_len
    self.tokens = b * t
    self.flops = flops_lib.flops_per_token(args, t).train * self.tokens
    self.flops_full_attention = flops_lib.flops_per_token(args, t, causal=False).train * self.tokens
    with sharding.use_mesh(self.ts.mesh, self.ts.rules):
      self.batch = sharding.host_batch_to_global(synthetic_batch(b, t, args.vocab_size), self.ts.mesh)
      t1 = time.perf_counter()
      self.compiled = self.ts.train_step.lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - t1
    self.setup_s = t1 - t0
    cost = self.compiled.cost_analysis()
    self.xla_flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost).get('flops', 0))
    self.temp_mib = self.compiled.memory_analysis().temp_size_in_bytes / 2**20
    self.run()  # warm up
    # the first step's loss and gradient norm (same init and batch for every variant of a
    # model: an A/B's variants must agree on them within float tolerance)
    self.first = {k: float(self.metrics[k]) for k in ('loss', 'grad_norm')}

  def run(self) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step."""
    w, c = time.perf_counter(), time.process_time()
    self.state, m = self.compiled(self.state, self.batch)
    jax.block_until_ready(m)
    self.metrics = m
    return time.perf_counter() - w, time.process_time() - c


class Probe:
  """The f32 2048^2 matmul that MFU is measured against, run in this process."""

  def __init__(self, n=2048):
    self.flops = 2.0 * n ** 3
    self.fn = jax.jit(lambda a, b: a @ b)
    # Two distinct operands, as flops.matmul_probe uses (a @ a reads half the memory).
    self.a, self.b = jnp.ones((n, n), jnp.float32), jnp.full((n, n), 2.0, jnp.float32)
    self.n = n
    self.fn(self.a, self.b).block_until_ready()

  def run(self, reps=2) -> tuple[float, float]:
    """(best wall, best CPU seconds) over reps matmuls."""
    best_w = best_c = float('inf')
    for _ in range(reps):
      w, c = time.perf_counter(), time.process_time()
      self.fn(self.a, self.b).block_until_ready()
      best_w, best_c = min(best_w, time.perf_counter() - w), min(best_c, time.process_time() - c)
    return best_w, best_c


def _summary(xs):
  return {'median': statistics.median(xs), 'max': max(xs), 'min': min(xs)}


def _load() -> list:
  return [round(x, 2) for x in os.getloadavg()]


def bench_mfu(rounds: int) -> dict:
  load0 = _load()
  peak = peak_lib.update_cpu_peak()  # probe now; the cache keeps the best ever taken
  config = load_config('stdlib_mtp')
  step, probe = Step(config), Probe()
  wall, cpu, steps, probes = [], [], [], []
  for _ in range(rounds):
    pw, pc = probe.run()
    sw, sc = step.run()
    steps.append(sw)
    probes.append(pw)
    wall.append((step.flops / sw) / (probe.flops / pw))
    cpu.append((step.flops / sc) / (probe.flops / pc))
  best_step, best_probe = min(steps), min(probes)
  median_step = statistics.median(steps)
  # The rounds' own probes are probes of this machine too: a higher one raises the cached
  # peak, so MFU is never divided by less than the best probe ever taken here.
  load1 = os.getloadavg()
  peak = peak_lib.update_cpu_peak(measured={
      'flops': probe.flops / best_probe, 'best_by_size': {str(probe.n): probe.flops / best_probe},
      'date': time.strftime('%Y-%m-%dT%H:%M:%S'), 'load_average': [load0[0], round(load1[0], 2)],
      'jax': jax.__version__, 'source': 'train_throughput.py --only mfu rounds'})
  return {
      'config': 'configs/stdlib_mtp.py',
      'attention': train_attention(config), 'devices': step.devices,
      'peak_gflops_cached': peak['flops'] / 1e9, 'peak_cache': peak,
      'mfu_best_step_over_peak': step.flops / best_step / peak['flops'],
      'mfu_median_step_over_peak': step.flops / median_step / peak['flops'],
      'steps_per_sec_median': 1.0 / median_step,
      'tokens_per_sec_median': step.tokens / median_step,
      'load_average': {'start': load0, 'end': _load()},
      'batch_size': config.data.batch_size, 'seq_len': config.data.seq_len,
      'model_flops_per_step': step.flops, 'xla_cost_analysis_flops_per_step': step.xla_flops,
      'probe_gflops_best': probe.flops / best_probe / 1e9,
      'step_time_best_s': best_step, 'step_time_median_s': statistics.median(steps),
      'tokens_per_sec_best': step.tokens / best_step,
      'mfu_per_round_wall': _summary(wall),
      'mfu_per_round_cpu_time': _summary(cpu),
      'mfu_best_step_over_best_probe_this_run': (step.flops / best_step) / (probe.flops / best_probe),
      'mfu_full_attention_count_median': statistics.median(wall) * step.flops_full_attention / step.flops,
      'compile_s': step.compile_s,
  }


def train_attention(config) -> str:
  return attn_lib.attention_impl(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)))


def maxtext_config(depth: int, remat: str = 'block', **model):
  """MaxText 0.2.5's CPU peer model (run_peer.sh): 4 layers, d 256, 8 x 32 heads, no GQA,
  MLP 704, V 1024, batch 16 x 256, float32. Its remat_policy=minimal saves the matmul
  outputs without batch dims: this project's remat='block'. MTP weight 0.1 per depth sum,
  as its mtp_loss_scaling_factor (the loss weight does not change the step's cost)."""
  c = load_config('stdlib_mtp')
  m = c.model
  m.n_heads = m.n_kv_heads = 8
  m.head_dim = 32
  m.mlp_dim = 704
  m.vocab_size = 1024
  m.remat = remat
  m.mtp.depth = depth
  m.mtp.lambda_values, m.mtp.lambda_boundaries = (0.1,), ()
  for k, v in model.items():
    setattr(m, k, v)
  c.data.batch_size, c.data.seq_len = 16, 256
  return c


def _round_robin(steps: dict, rounds: int) -> dict:
  times = {k: [] for k in steps}
  for _ in range(rounds):  # every variant sees the same background load
    for k, s in steps.items():
      times[k].append(s.run()[0])
  return times


def bench_maxtext(rounds: int, depths=(0, 1, 3), remat: str = 'block') -> dict:
  load0 = _load()
  peak = peak_lib.cpu_peak()
  steps = {d: Step(maxtext_config(d, remat)) for d in depths}
  times = _round_robin(steps, rounds)
  out = {'model': 'MaxText CPU peer shape: 4 layers, d 256, 8x32 heads, MLP 704, V 1024, '
                  f'B 16 x T 256, float32, remat={remat}',
         'attention': train_attention(maxtext_config(0, remat)), 'devices': STEP_DEVICES,
         'peak_gflops_cached': peak['flops'] / 1e9, 'depths': {}}
  for d, s in steps.items():
    med, best = statistics.median(times[d]), min(times[d])
    out['depths'][str(d)] = {
        'step_time_median_s': med, 'step_time_best_s': best,
        'tokens_per_sec_median': s.tokens / med, 'tokens_per_sec_best': s.tokens / best,
        'steps_per_sec_median': 1.0 / med, 'model_gflops_per_step': s.flops / 1e9,
        'mfu_best_step_over_peak': s.flops / best / peak['flops'], 'compile_s': s.compile_s}
  out['load_average'] = {'start': load0, 'end': _load()}
  return out


AB_VARIANTS = {  # name: (config builder, {variant: model overrides})
    'stdlib_mtp': (lambda **m: _with_model(load_config('stdlib_mtp'), m),
                   {'xla': {'attention_core': 'xla'}, 'blocked64': {'attention_core': 'blocked'}}),
    'maxtext_D1': (lambda **m: maxtext_config(1, **m),
                   {'xla': {'attention_core': 'xla'}, 'blocked64': {'attention_core': 'blocked'}}),
}

# --ab_set stdlib_block: configs/stdlib_mtp.py (2 x 128 heads, remat none): attention blocks of
# 64 / 128, and the saved core forced on (without remat it is off by default)
STDLIB_BLOCK_VARIANTS = {
    'stdlib_mtp': (lambda **m: _with_model(load_config('stdlib_mtp'), m),
                   {'blocked64': {'attention_block': 64}, 'blocked128': {'attention_block': 128},
                    'saved_core': {'attn': 'saved'}}),
}

# --ab_set stdlib_norm: configs/stdlib_mtp.py with its RMSNorms autodiff vs the custom VJP
STDLIB_NORM_VARIANTS = {
    'stdlib_mtp': (lambda **m: _with_model(load_config('stdlib_mtp'), m),
                   {'norm_autodiff': {'norm': 'autodiff'}, 'norm_vjp': {'norm': 'vjp'}}),
}


# --ab_set stdlib_devices: configs/stdlib_mtp.py on one CPU device and on two (data parallel,
# the trainer's --cpu_devices auto); needs --cpu_devices 2 (or auto on a 2+ core host)
STDLIB_DEVICES_VARIANTS = {
    'stdlib_mtp': (lambda **m: _with_model(load_config('stdlib_mtp'), m),
                   {'one_device': {'devices': 1}, 'two_devices': {'devices': 2}}),
}

# --ab_set stdlib_loss: configs/stdlib_mtp.py's batched loss as it was before issue 14's sixth
# pass (concatenated rows) against now (stacked depths), on --cpu_devices devices
STDLIB_LOSS_VARIANTS = {
    'stdlib_mtp': (lambda **m: _with_model(load_config('stdlib_mtp'), m),
                   {'loss_concat': {'head_sums': 'concat'}, 'now': {}}),
}


# Issue 14, second pass: the MaxText-shape step's variants (--only ab --ab_set train_speed).
# 'attn': 'before' traces the variant with blocked_attention_before (below) in place of
# attn_lib.blocked_causal_attention; loss_chunk 256 = T is the scanned per-depth loss over the
# whole length (what loss_chunk 0 ran before), loss_chunk 0 is now one batched projection of
# all depths (loss._head_sums_batched).
TRAIN_SPEED_VARIANTS = {
    'before': {'attn': 'before', 'loss_chunk': 256},
    'batched_loss': {'attn': 'before', 'loss_chunk': 0},
    'new_attn': {'loss_chunk': 256},
    'now': {'loss_chunk': 0},
    'now_remat_none': {'loss_chunk': 0, 'remat': 'none'},
    # issue 14, third pass: 'now' runs attn_lib._saved_core under remat block, saving its output,
    # log-sum-exp and heads-major q / k / v; 'saved_out_lse' saves only the first two;
    # 'autodiff_core' differentiates the blocked core by autodiff ('now' before the third pass)
    'autodiff_core': {'loss_chunk': 0, 'attn': 'autodiff'},  # 'now' before the saved core
    'block32': {'loss_chunk': 0, 'attention_block': 32},
    'rope_flip': {'loss_chunk': 0, 'rope': 'flip'},
    'block128': {'loss_chunk': 0, 'attention_block': 128},
    'saved_out_lse': {'loss_chunk': 0, 'saved_names': ('attention_out', 'attention_lse')},
    # issue 14, fourth pass: 'norm': 'vjp' / 'autodiff' / 'vjp_v1' every RMSNorm's form (the
    # closed form, layers.rms_normalize_vjp, is the default now), 'ce' the batched loss's
    # cross-entropy (tried, not kept), 'combine' the MTP combine's projection (tried, not kept)
    'norm_vjp': {'loss_chunk': 0, 'norm': 'vjp'},
    'norm_autodiff': {'loss_chunk': 0, 'norm': 'autodiff'},  # 'now' before the fourth pass
    'norm_vjp_v1': {'loss_chunk': 0, 'norm': 'vjp_v1'},  # the first backward (row reduction)
    'ce_vjp': {'loss_chunk': 0, 'ce': 'vjp'},
    'norm_ce_vjp': {'loss_chunk': 0, 'norm': 'vjp', 'ce': 'vjp'},
    'ce_lse_vjp': {'loss_chunk': 0, 'ce': 'lse_vjp'},
    'combine_split': {'loss_chunk': 0, 'combine': 'split'},
    # issue 14, fifth pass: the same step on one CPU device and on two (data parallel; the
    # trainer's --cpu_devices auto); needs --cpu_devices 2 (or auto on a 2+ core host)
    'one_device': {'loss_chunk': 0, 'devices': 1},
    'two_devices': {'loss_chunk': 0, 'devices': 2},
    # issue 14, sixth pass: the batched loss with every depth's rows concatenated along B*T
    # (the form before: an all-to-all on a data-parallel mesh) against stacked (now)
    'loss_concat': {'loss_chunk': 0, 'head_sums': 'concat'},
}


def blocked_attention_before(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
                             mask_Bx1xTxT: jax.Array, block: int = 64, saved_core: bool = False) -> jax.Array:
  """attn_lib.blocked_causal_attention as it was before issue 14's second pass (5-D heads-major
  einsums, a select for the mask, softmax then P V): the A/B control of 'attn': 'before'.

  Causal self-attention that never computes a fully masked key block.

  Query block [a, e) can only see keys [0, e) (the mask is causal, a precondition: the
  training mask of `attention_mask`), so its scores are [e - a, e] instead of [e - a, T]:
  for T = 256 and blocks of 64, 62.5 % of the full T x T work. Each block's softmax is
  exact (the keys of a block row are all there), so no online-softmax rescaling is
  needed, and autodiff gives the backward (a hand-written VJP was measured no faster).
  Heads-major einsums [B, K, G, t, H] (one transpose in, one out) let XLA:CPU run the
  score / value products as plain batched matmuls. GQA: query head n uses kv head
  n // (N / K), as jax.nn.dot_product_attention does. Returns [B, T, N, H].
  """
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxTxKxH.shape[2]
  g = n // kv
  scale = 1.0 / np.sqrt(h)
  q_BxKxGxTxH = jnp.transpose((q_BxTxNxH * scale).reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
  k_BxKxTxH = jnp.transpose(k_BxTxKxH, (0, 2, 1, 3))
  v_BxKxTxH = jnp.transpose(v_BxTxKxH, (0, 2, 1, 3))
  outs = []
  for a in range(0, t, block):
    e = min(a + block, t)
    s_BxKxGxQxE = jnp.einsum('bkgqh,bksh->bkgqs', q_BxKxGxTxH[:, :, :, a:e], k_BxKxTxH[:, :, :e],
                             preferred_element_type=jnp.float32)
    s_BxKxGxQxE = jnp.where(mask_Bx1xTxT[:, :, None, a:e, :e], s_BxKxGxQxE, attn_lib._MASKED)
    p = jax.nn.softmax(s_BxKxGxQxE, axis=-1).astype(v_BxTxKxH.dtype)
    outs.append(jnp.einsum('bkgqs,bksh->bkgqh', p, v_BxKxTxH[:, :, :e]))
  o_BxKxGxTxH = jnp.concatenate(outs, axis=3)
  return jnp.transpose(o_BxKxGxTxH, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def apply_rope_flip(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, theta: float,
                    scaling: tuple = ()) -> jax.Array:
  """layers.apply_rope without its concatenate (issue 14 third pass, tried, not kept: 1.01x /
  1.09x the step time at D 0 / 3): the halves as a size-2 axis, out = x cos + swap(x) [-sin, sin]."""
  b, t, n, h = x_BxTxNxH.shape
  inv_freq = layers.rope_inv_freq(h, theta, scaling)
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq
  sin_BxTxF, cos_BxTxF = jnp.sin(angles_BxTxF), jnp.cos(angles_BxTxF)
  sin_BxTx1x2xF = jnp.stack([-sin_BxTxF, sin_BxTxF], axis=2)[:, :, None]
  cos_BxTx1x1xF = cos_BxTxF[:, :, None, None]
  x_BxTxNx2xF = x_BxTxNxH.astype(jnp.float32).reshape(b, t, n, 2, h // 2)
  out = x_BxTxNx2xF * cos_BxTx1x1xF + jnp.flip(x_BxTxNx2xF, axis=3) * sin_BxTx1x2xF
  return out.reshape(b, t, n, h).astype(x_BxTxNxH.dtype)




# Issue 14, fourth pass, tried and not kept (benchmarks/RESULTS.md): custom VJPs for the batched
# loss's cross-entropy ('ce' variants) and the MTP combine as two summed dots ('combine').
@jax.custom_vjp
def cross_entropy_vjp(logits_NxV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
  """loss_lib.cross_entropy_autodiff with one pass fewer: the row max is read from the argmax
  (a gather, not a second max reduction), and the backward is (exp(logits - lse) - onehot) g
  from the saved logits and row log-sum-exp."""
  return _ce_fwd(logits_NxV, targets_N)[0]


def _ce_fwd(logits, tgt):
  pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  m = jax.lax.stop_gradient(jnp.take_along_axis(logits, pred[..., None], axis=-1))
  lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True)) + m
  nll = (lse - jnp.take_along_axis(logits, tgt[..., None], axis=-1))[..., 0]
  return (nll, pred), (logits, lse, tgt)


def _ce_bwd(res, cts):
  logits, lse, tgt = res
  g = cts[0][..., None]
  onehot = jnp.arange(logits.shape[-1]) == tgt[..., None]
  dlogits = (jnp.exp(logits - lse) - onehot.astype(logits.dtype)) * g
  return dlogits, None


cross_entropy_vjp.defvjp(_ce_fwd, _ce_bwd)


@jax.custom_vjp
def cross_entropy_lse_vjp(logits_NxV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
  """loss_lib.cross_entropy_autodiff's forward as it is (its max and argmax reductions side by side),
  with cross_entropy_vjp's backward from the saved logits and row log-sum-exp."""
  return _ce_lse_fwd(logits_NxV, targets_N)[0]


def _ce_lse_fwd(logits, tgt):
  lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  nll = (lse - jnp.take_along_axis(logits, tgt[..., None], axis=-1))[..., 0]
  return (nll, jnp.argmax(logits, axis=-1).astype(jnp.int32)), (logits, lse, tgt)


cross_entropy_lse_vjp.defvjp(_ce_lse_fwd, _ce_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_normalize_vjp_v1(x_NxD, scale_D, eps, dtype):
  """layers.rms_normalize_vjp with its first backward: mean(x_hat * scale * dy) as a row
  reduction (XLA:CPU materialises the [N, d] scale broadcast that feeds it)."""
  return layers.rms_normalize_autodiff(x_NxD, scale_D, eps, dtype)


def _rms_v1_bwd(eps, dtype, res, dy):
  x, r, scale = res
  x_hat = x.astype(jnp.float32) * r
  u = dy * scale
  dx = r * (u - x_hat * jnp.mean(x_hat * u, -1, keepdims=True))
  return dx.astype(x.dtype), jnp.sum((dy * x_hat).reshape(-1, x.shape[-1]), 0).astype(scale.dtype)


rms_normalize_vjp_v1.defvjp(layers._rms_vjp_fwd, _rms_v1_bwd)


def combine_split(self, h_prev_BxTxD: jax.Array, emb_BxTxD: jax.Array, decode: bool = False) -> jax.Array:
  """SequentialMTP.combine (training path) as enorm(e) @ W[:d] + hnorm(h) @ W[d:]: two
  [N, d] x [d, d] products summed instead of one over the concatenated [N, 2d]."""
  assert not decode
  b, t, d = emb_BxTxD.shape
  w_2DxD = self.eh_proj.kernel[...]
  h = (layers.project(self.enorm(emb_BxTxD).reshape(b * t, d), w_2DxD[:d], self.eh_proj.dtype)
       + layers.project(self.hnorm(h_prev_BxTxD).reshape(b * t, d), w_2DxD[d:], self.eh_proj.dtype))
  return sharding.constrain(h.reshape(b, t, d), ('batch', 'length', 'act_embed'))


def head_sums_concat(norms, hiddens, w_DxV, targets_KxBxT, mask_KxBxT, teacher_logits=None):
  """loss._head_sums_batched before issue 14's sixth pass (the A/B control of 'head_sums':
  'concat'): every depth's rows concatenated along B*T, which on a data-parallel mesh
  reshards them (an all-to-all) and the logits back. Data targets only (no teacher)."""
  assert teacher_logits is None
  num = len(hiddens)
  b, t, d = hiddens[0].shape
  x_KNxD = jnp.concatenate([norm(h).reshape(b * t, d) for norm, h in zip(norms, hiddens)])
  logits_KxBxTxV = jnp.dot(x_KNxD, w_DxV.astype(x_KNxD.dtype),
                           preferred_element_type=jnp.float32).reshape(num, b, t, -1)
  nll, pred_KxBxT = loss_lib.cross_entropy(logits_KxBxTxV, targets_KxBxT)
  mf = mask_KxBxT.astype(jnp.float32)
  return (jnp.sum(nll * mf, axis=(1, 2)), jnp.sum((pred_KxBxT == targets_KxBxT) * mf, axis=(1, 2)),
          pred_KxBxT)


def train_speed_variants(depths, names=None) -> dict:
  names = names or list(TRAIN_SPEED_VARIANTS)
  return {f'maxtext_D{d}': (lambda d=d, **m: maxtext_config(d, **m),
                            {n: TRAIN_SPEED_VARIANTS[n] for n in names}) for d in depths}


def _with_model(c, model: dict):
  for k, v in model.items():
    setattr(c.model, k, v)
  return c


def _autodiff_core(blocked):
  """attn_lib.blocked_causal_attention with saved_core forced off (the A/B control)."""
  return lambda q, k, v, mask, block=64, saved_core=False: blocked(q, k, v, mask, block, False)


def _forced_saved_core(blocked):
  """attn_lib.blocked_causal_attention with saved_core forced on (also without remat)."""
  return lambda q, k, v, mask, block=64, saved_core=False: blocked(q, k, v, mask, block, True)


def _build_step(build, over: dict) -> 'Step':
  """A variant's Step; while it is traced, 'attn' swaps the blocked core (before: the form
  before the second pass; autodiff: saved_core off), 'rope' the RoPE, 'saved_names' the
  names the block remat policy saves (attn_lib.ATTENTION_SAVED_NAMES), 'norm' every RMSNorm's
  form (layers.rms_normalize), 'ce' the batched loss's cross-entropy (loss.cross_entropy),
  'combine' SequentialMTP.combine (split: combine_split), 'devices' the CPU devices it
  trains on (default STEP_DEVICES)."""
  over = dict(over)
  devices = over.pop('devices', None)
  if devices and devices > len(jax.devices()):
    raise SystemExit(f'variant needs {devices} devices, this process has {len(jax.devices())} '
                     '(--cpu_devices)')
  saved = attn_lib.blocked_causal_attention, layers.apply_rope
  saved_forms = layers.rms_normalize, loss_lib.cross_entropy, model_lib.SequentialMTP.combine
  saved_head_sums = loss_lib._head_sums_batched  # pylint: disable=protected-access
  attn, rope = over.pop('attn', None), over.pop('rope', None)
  head_sums = over.pop('head_sums', None)
  if head_sums:
    loss_lib._head_sums_batched = {'concat': head_sums_concat}[head_sums]  # pylint: disable=protected-access
  norm, ce, combine = over.pop('norm', None), over.pop('ce', None), over.pop('combine', None)
  if combine:
    model_lib.SequentialMTP.combine = {'split': combine_split}[combine]
  if norm:
    layers.rms_normalize = {'vjp': layers.rms_normalize_vjp, 'autodiff': layers.rms_normalize_autodiff,
                            'vjp_v1': rms_normalize_vjp_v1}[norm]
  if ce:
    loss_lib.cross_entropy = {'vjp': cross_entropy_vjp, 'lse_vjp': cross_entropy_lse_vjp}[ce]
  saved_names = attn_lib.ATTENTION_SAVED_NAMES
  attn_lib.ATTENTION_SAVED_NAMES = over.pop('saved_names', saved_names)
  if attn:
    attn_lib.blocked_causal_attention = {'before': blocked_attention_before,
                                       'autodiff': _autodiff_core(saved[0]),
                                       'saved': _forced_saved_core(saved[0])}[attn]
  if rope:
    layers.apply_rope = {'flip': apply_rope_flip}[rope]
  try:
    return Step(build(**over), devices)
  finally:
    attn_lib.blocked_causal_attention, layers.apply_rope = saved
    layers.rms_normalize, loss_lib.cross_entropy, model_lib.SequentialMTP.combine = saved_forms
    attn_lib.ATTENTION_SAVED_NAMES = saved_names
    loss_lib._head_sums_batched = saved_head_sums  # pylint: disable=protected-access


def bench_ab(rounds: int, variants=None) -> dict:
  """Each model's variants round robin in one process; ratio = median of per-round
  t(variant) / t(first variant). Also each variant's first-step loss and gradient norm
  (the same init and batch: they must agree) and its relative difference to the first's."""
  out = {'load_average_start': _load()}
  for name, (build, vs) in (variants or AB_VARIANTS).items():
    steps = {v: _build_step(build, over) for v, over in vs.items()}
    times = _round_robin(steps, rounds)
    base = next(iter(vs))
    row = {}
    for v in vs:
      ratios = [t / t0 for t, t0 in zip(times[v], times[base])]
      row[v] = {'step_time_best_s': min(times[v]), 'step_time_median_s': statistics.median(times[v]),
                f'time_ratio_vs_{base}_median': statistics.median(ratios),
                'tokens_per_sec_median': steps[v].tokens / statistics.median(times[v]),
                'first_step': steps[v].first, 'temp_MiB': steps[v].temp_mib,
                'first_step_rel_diff': {k: abs(x - steps[base].first[k]) / abs(steps[base].first[k])
                                        for k, x in steps[v].first.items()},
                'overrides': {k: str(x) for k, x in vs[v].items()}}
    out[name] = row
    print(name, json.dumps(row), flush=True)
  out['load_average_end'] = _load()
  return out


def bench_overhead(rounds: int) -> dict:
  steps = {}
  for depth in (0, 1, 2, 3):
    c = load_config('stdlib_mtp')
    c.model.mtp.depth = depth
    c.model.mtp.lambda_values, c.model.mtp.lambda_boundaries = (0.3,), ()
    steps[depth] = Step(c)
  times = {d: [] for d in steps}
  ratios = {d: [] for d in steps if d}
  for _ in range(rounds):  # round robin: every depth sees the same background load
    t = {d: s.run()[0] for d, s in steps.items()}
    for d in steps:
      times[d].append(t[d])
      if d:
        ratios[d].append(t[d] / t[0])
  out = {'config': 'configs/stdlib_mtp.py with model.mtp.depth = D', 'depths': {}}
  for d in steps:
    flop_ratio = steps[d].flops / steps[0].flops
    row = {'step_time_best_s': min(times[d]), 'flop_ratio': flop_ratio}
    if d:
      r = statistics.median(ratios[d])
      row.update({'time_ratio_median': r, 'time_ratio_of_best': min(times[d]) / min(times[0]),
                  'time_ratio_over_flop_ratio': r / flop_ratio})
    out['depths'][str(d)] = row
  return out


def moe_variants() -> dict:
  """configs/dsv3_mini.py and two controls with the same active FLOPs per token: a dense
  SwiGLU of width moe_intermediate_size x (K + shared) in place of each MoE layer, and
  4x the routed experts at the same K; dsv3_mini and the 4x one also with the 'ragged'
  dispatch (moe.py), for the A/B of the CPU grouped matmul."""
  def build(**over):
    c = load_config('dsv3_mini')
    for k, v in over.items():
      _set(c, k, v)
    return c
  mo = load_config('dsv3_mini').model.moe
  active = mo.moe_intermediate_size * (mo.num_experts_per_tok + mo.n_shared_experts)
  return {'dense_same_active': build(**{'model.mlp': 'dense', 'model.mlp_dim': active}),
          'dsv3_mini': build(),
          'moe_4x_experts': build(**{'model.moe.n_routed_experts': 4 * mo.n_routed_experts}),
          # The same two with jax.lax.ragged_dot (a masked dense product on XLA:CPU)
          'dsv3_mini_ragged': build(**{'model.moe.dispatch': 'ragged'}),
          'moe_4x_experts_ragged': build(**{'model.moe.n_routed_experts': 4 * mo.n_routed_experts,
                                            'model.moe.dispatch': 'ragged'})}


def _set(c, path, value):
  *head, last = path.split('.')
  for h in head:
    c = c[h]
  c[last] = value


def bench_moe(rounds: int) -> dict:
  """dsv3_mini's train step (MLA + DeepSeekMoE): tokens/s, MFU over the cached peak with
  only the active parameters' FLOPs (flops.py), and the MoE dispatch overhead: step time
  ratio against the same-active-FLOPs dense control over their FLOP ratio, round robin."""
  load0 = _load()
  peak = peak_lib.cpu_peak()
  steps = {name: Step(c) for name, c in moe_variants().items()}
  times = _round_robin(steps, rounds)
  base = 'dense_same_active'
  out = {'config': 'configs/dsv3_mini.py', 'peak_gflops_cached': peak['flops'] / 1e9,
         'rounds': rounds, 'variants': {}}
  for name, st in steps.items():
    ratios = [t / t0 for t, t0 in zip(times[name], times[base])]
    med = statistics.median(times[name])
    flop_ratio = st.flops / steps[base].flops
    out['variants'][name] = {
        'step_time_best_s': min(times[name]), 'step_time_median_s': med,
        'tokens_per_sec_median': st.tokens / med,
        'mfu_best_step_over_peak': st.flops / min(times[name]) / peak['flops'],
        'model_flops_per_step': st.flops, 'flop_ratio_vs_dense': flop_ratio,
        'time_ratio_vs_dense_median': statistics.median(ratios),
        'dispatch_overhead_time_over_flop_ratio': statistics.median(ratios) / flop_ratio}
  out['load_average'] = {'start': load0, 'end': _load()}
  return out


def memory_config(depth: int, loss_chunk: int = 0, remat: str = 'none', scan: bool = False,
                  batch: int = 8):
  c = load_config('stdlib_mtp')
  c.model.vocab_size = 32768
  c.model.mtp.depth = depth
  c.model.mtp.lambda_values, c.model.mtp.lambda_boundaries = (0.3,), ()
  c.model.loss_chunk = loss_chunk
  c.model.remat = remat
  c.model.scan_layers = scan
  c.data.seq_len = 1024
  c.data.batch_size = batch
  return c


def compiled_memory(config) -> dict:
  """XLA's memory analysis of the compiled train step (compiled, never run)."""
  ts, state = steps_lib.setup(config, jax.devices()[:1])
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(config))
  with sharding.use_mesh(ts.mesh, ts.rules):
    batch = sharding.host_batch_to_global(
        synthetic_batch(config.data.batch_size, config.data.seq_len, args.vocab_size), ts.mesh)
    mem = ts.train_step.lower(state, batch).compile().memory_analysis()
  return {'temp_bytes': int(mem.temp_size_in_bytes),
          'argument_bytes': int(mem.argument_size_in_bytes)}


# (loss_chunk, remat, scan_layers) rows; the last two are the memory-lean settings.
MEMORY_ROWS = [(0, 'none', False), (256, 'none', False), (256, 'full', False),
               (256, 'block', True), (256, 'full', True)]
MEMORY_AWARE_FLAG = '--xla_cpu_enable_concurrency_optimized_scheduler=false'


def bench_memory(rows=MEMORY_ROWS) -> dict:
  b, t, v = 8, 1024, 32768
  out = {'setup': f'stdlib_mtp model (d=256, 4 layers, 2x128 heads), vocab {v}, T={t}, '
                  f'batch {b}, float32; one depth of logits = {4 * b * t * v / 2**30:.2f} GiB',
         'xla_flags': os.environ.get('XLA_FLAGS', ''), 'runs': []}
  for loss_chunk, remat, scan in rows:
    row = {'loss_chunk': loss_chunk, 'remat': remat, 'scan_layers': scan}
    for depth in (1, 4):
      row[f'D{depth}_temp_MiB'] = compiled_memory(
          memory_config(depth, loss_chunk, remat, scan))['temp_bytes'] / 2**20
    row['temp_ratio_D4_over_D1'] = row['D4_temp_MiB'] / row['D1_temp_MiB']
    out['runs'].append(row)
    print(json.dumps(row), flush=True)
  return out


def bench_memory_both_schedulers() -> dict:
  """XLA:CPU's default (concurrency-optimised) scheduler, then its memory-aware one.

  The scheduler is a process-wide XLA flag, so the second pass runs in a subprocess.
  """
  import subprocess
  out = {'default_cpu_scheduler': bench_memory()}
  env = dict(os.environ, XLA_FLAGS=MEMORY_AWARE_FLAG)
  code = ('import sys, json; sys.argv = sys.argv[:1]; sys.path.insert(0, %r); '
          'import train_throughput as tt; '
          'print("RESULT", json.dumps(tt.bench_memory(tt.MEMORY_ROWS[-2:])))'
          % os.path.join(REPO, 'benchmarks'))
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  out['memory_aware_cpu_scheduler'] = (json.loads(lines[-1][7:]) if lines
                                       else {'error': proc.stderr[-2000:]})
  return out


def bench_compile() -> dict:
  out = {}
  tiny = load_config('tiny')
  tiny.model.vocab_size = 320  # no tokenizer needed
  out['tiny'] = Step(tiny).compile_s
  for scan in (False, True):
    c = load_config('stdlib_mtp')
    c.model.n_layers = 12
    c.model.scan_layers = scan
    s = Step(c)
    out[f'12_layers_scan_{scan}'] = s.compile_s
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.path.join(REPO, 'benchmarks', 'train_throughput.json'))
  parser.add_argument('--only', default='mfu,overhead,memory,compile')
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--depths', type=lambda x: tuple(int(d) for d in x.split(',')),
                      default=(0, 1, 3), help='maxtext section: MTP depths')
  parser.add_argument('--remat', default='block', help='maxtext section: model.remat')
  parser.add_argument('--ab_set', default='attention', choices=('attention', 'train_speed', 'stdlib_block', 'stdlib_norm',
                               'stdlib_devices', 'stdlib_loss'),
                      help='ab section: attention = xla vs blocked core (stdlib_mtp, MaxText '
                           'shape D 1); train_speed = TRAIN_SPEED_VARIANTS at --depths')
  parser.add_argument('--variants', default='', help='ab train_speed: comma-separated names')
  parser.add_argument('--cpu_devices', default='auto',
                      help="CPU devices per train step (data parallel): auto = the trainer's "
                           "default (scripts/train.py --cpu_devices auto), or a number")
  parser.add_argument('--host_malloc', default='auto', choices=host_memory.MODES,
                      help="the C allocator's handling of freed XLA buffers, as scripts/train.py "
                           "--host_malloc (auto: keep them on a CPU host)")
  a = parser.parse_args()
  global STEP_DEVICES  # pylint: disable=global-statement
  n = distributed.resolve_cpu_devices(a.cpu_devices)  # before anything starts JAX's backend
  if n:
    jax.config.update('jax_num_cpu_devices', n)
  STEP_DEVICES = n or 1
  cpu_model = ''
  if os.path.exists('/proc/cpuinfo'):
    cpu_model = next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo')
                      if l.startswith('model name')), '')
  result = {'machine': {'platform': platform.platform(), 'processor': cpu_model or platform.processor(),
                        'cpu_count': os.cpu_count(), 'jax': jax.__version__,
                        'devices': [d.device_kind for d in jax.devices()[:1]],
                        'step_devices': STEP_DEVICES, 'cpu_devices_flag': a.cpu_devices,
                        'host_malloc': HOST_MALLOC,
                        'date': datetime.datetime.now().isoformat(timespec='seconds'),
                        'load_average_at_start': os.getloadavg()}}
  for name in a.only.split(','):
    t0 = time.time()
    result[name] = {'mfu': lambda: bench_mfu(a.rounds), 'overhead': lambda: bench_overhead(a.rounds),
                    'maxtext': lambda: bench_maxtext(a.rounds, a.depths, a.remat),
                    'ab': lambda: bench_ab(a.rounds, {'attention': AB_VARIANTS, 'stdlib_block': STDLIB_BLOCK_VARIANTS,
                                                      'stdlib_norm': STDLIB_NORM_VARIANTS,
                                                      'stdlib_devices': STDLIB_DEVICES_VARIANTS,
                                                      'stdlib_loss': STDLIB_LOSS_VARIANTS}.get(a.ab_set) or
                                           train_speed_variants(a.depths, [v for v in a.variants.split(',') if v])),
                    'moe': lambda: bench_moe(a.rounds),
                    'memory': bench_memory_both_schedulers, 'compile': bench_compile}[name]()
    result[name]['bench_seconds'] = time.time() - t0
    print(name, json.dumps(result[name], indent=1), flush=True)
  result['machine']['load_average_at_end'] = os.getloadavg()
  with open(a.out, 'w') as f:
    json.dump(result, f, indent=1)
  print('wrote', a.out)


if __name__ == '__main__':
  main()
