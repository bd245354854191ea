"""Training speed: MFU, the MTP overhead, MoE dispatch, memory, compile time, A/B in one process.

  python benchmarks/train_throughput.py --only mfu --rounds 8
  python benchmarks/train_throughput.py --only mfu --rounds 8 \\
    --out benchmarks/results/train_mfu.json

Sections (--only, comma-separated; each timed section runs its steps round robin in one
process, so the background load hits every variant alike):
  mfu       the configs/stdlib_mtp.py train step in float32: steps/s, tokens/s, MFU = model FLOPs
            (mtp_jax.train.flops) / step time / the host's peak in the step's compute dtype
            (mtp_jax.runtime.peak: the best matmul probe of that dtype ever taken here,
            cached; this section's own 2048^2 probes, taken between its steps, raise it
            when higher)
  overhead  step time at M = 1, 2, 3 over M = 0 (same trunk), next to the FLOP ratio
  moe       configs/dsv3_mini.py (MLA + DeepSeekMoE): tokens/s, MFU of the active parameters,
            and the dispatch overhead against a dense control of the same active FLOPs
            (also with 4x the routed experts, and with model.moe.dispatch = ragged)
  maxtext   MaxText 0.2.5's CPU peer model (maxtext_config) at --depths: tokens/s; what
            vs_maxtext.py runs beside MaxText
  memory    peak temporary memory of the compiled step (XLA's memory analysis, never run) at
            vocab 32k, T 1024, M = 1 vs M = 4, under XLA:CPU's default scheduler and (in a
            child process: the flag is process-wide) its memory-aware one
  compile   train-step compile time: configs/tiny.py and a 12-layer model with and without
            model.scan_layers (persistent compilation cache off)
  ab        --ab_set's variants of one model, each a set of config overrides
            (AB_SETS): ratio = median of per-round t(variant) / t(first variant), with each
            variant's first-step loss and gradient norm (equal inits: they must agree), its
            MFU over its compute dtype's peak and its matmul FLOPs by dot form
            (aot.hlo.cpu_dot_forms; 'bf16 kernels' is the fast bf16 form), and where one
            traced step of each goes by op kind and region (train/step_profile.py)

--cpu_devices and --host_malloc are the trainer's (scripts/train.py) with its defaults, so
the step timed is the step the trainer runs.
"""
from __future__ import annotations

import os
import sys
import time

import common  # benchmarks/common.py: no JAX
from mtp_jax.runtime import host_memory  # noqa: E402  (standard library only)

# The allocator setting the trainer makes (--host_malloc), before JAX starts a thread.
HOST_MALLOC = (host_memory.configure(host_memory.mode_from_argv(sys.argv))
               if __name__ == '__main__' else None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax import config_files  # noqa: E402
from mtp_jax.data import tokenizers  # noqa: E402
from mtp_jax.model import ModelArgs  # noqa: E402
from mtp_jax.model import attention as attn_lib  # noqa: E402
from mtp_jax.runtime import distributed, sharding  # noqa: E402
from mtp_jax.runtime import peak as peak_lib  # noqa: E402
from mtp_jax.train import flops as flops_lib  # noqa: E402
from mtp_jax.train import step_profile  # noqa: E402
from mtp_jax.train import steps as steps_lib  # noqa: E402
from mtp_jax.train.aot.hlo_read import cpu_dot_forms  # noqa: E402

NAME = 'train_throughput'
SECTIONS = ('mfu', 'overhead', 'moe', 'maxtext', 'memory', 'compile', 'ab')
# The sections with a committed result of their own (benchmarks/results/<name>.json): a run
# of that one section is recorded under that name.
RESULT_NAMES = {'mfu': 'train_mfu', 'overhead': 'train_overhead', 'moe': 'train_moe',
                'memory': 'train_memory'}
NOTE = ('Ratios compare variants timed round robin in one process, so the load hits each '
        'alike; MFU divides model FLOPs (the active parameters only for MoE) by "peak".')

# CPU devices a Step trains on (data parallel): main() sets it from --cpu_devices, whose
# default 'auto' is the trainer's rule (2 on a 2+ core CPU host).
STEP_DEVICES = 1


def load_config(name: str):
  """configs/<name>.py's get_config()."""
  return config_files.load(os.path.join(common.REPO, 'configs', f'{name}.py'))


def shrink(c):
  """The --smoke size of a config: the same kind of model, a few thousand parameters."""
  m = c.model
  m.d_model, m.n_layers, m.mlp_dim, m.vocab_size = 32, min(m.n_layers, 2), 64, 64
  m.n_heads = m.n_kv_heads = 2
  if m.attention == 'mla':
    m.mla.q_lora_rank, m.mla.kv_lora_rank = 16, 8
    m.mla.qk_nope_head_dim, m.mla.qk_rope_head_dim, m.mla.v_head_dim = 8, 4, 8
  else:
    m.head_dim = 16
  if m.mlp == 'moe':
    m.moe.moe_intermediate_size = 16
  c.data.batch_size, c.data.seq_len = 2, 32
  c.train.eval_decode_tokens = 8  # room for the eval prompts in a 32-token row
  return c


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


def model_args(config) -> ModelArgs:
  return ModelArgs.from_config(tokenizers.resolve_vocab_size(config))


class Step:
  """One config's compiled train step on STEP_DEVICES devices (or `devices`), with its
  state and a synthetic batch; compiled, then run once (warm-up)."""

  def __init__(self, config, devices: int | None = None):
    self.devices = devices or STEP_DEVICES
    if self.devices > len(jax.devices()):
      raise SystemExit(f'error: a step on {self.devices} devices, this process has '
                       f'{len(jax.devices())} (--cpu_devices)')
    self.ts, self.state = steps_lib.setup(config, jax.devices()[:self.devices])
    self.config = config
    args = model_args(config)
    b, t = config.data.batch_size, config.data.seq_len
    self.tokens = b * t
    self.flops = flops_lib.flops_per_token(args, t).train * self.tokens
    self.flops_full_attention = flops_lib.flops_per_token(args, t, causal=False).train * self.tokens
    with sharding.use_mesh(self.ts.mesh, self.ts.rules):
      self.batch = sharding.host_batch_to_global(synthetic_batch(b, t, args.vocab_size),
                                                 self.ts.mesh)
      t0 = time.perf_counter()
      self.compiled = self.ts.train_step.lower(self.state, self.batch).compile()
    self.compile_s = time.perf_counter() - t0
    cost = self.compiled.cost_analysis()
    self.xla_flops = float((cost[0] if isinstance(cost, (list, tuple)) else cost).get('flops', 0))
    self.temp_mib = self.compiled.memory_analysis().temp_size_in_bytes / 2**20
    self.dtype = peak_lib.cpu_dtype(args.dtype)
    forms = cpu_dot_forms(self.compiled.as_text())
    self.dot_forms = {k: v / max(sum(forms.values()), 1.0) for k, v in forms.items()}
    self.run()
    # The first step's loss and gradient norm: every variant of a model starts from the same
    # init and batch, so an A/B's variants must agree on them within float tolerance.
    self.first = {k: float(self.metrics[k]) for k in ('loss', 'grad_norm')}

  def profile(self, steps: int = 2) -> dict:
    """`steps` steps under one jax.profiler trace, the time of one by op kind and region
    (train/step_profile.py's breakdown; more than one: the trace's start-up cost is shared)."""
    def run():
      for _ in range(steps):
        self.run()
    path = step_profile.trace_run(run)
    return step_profile.breakdown(path, self.compiled.as_text(), steps=steps)

  def run(self) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step."""
    w, c = time.perf_counter(), time.process_time()
    self.state, m = self.compiled(self.state, self.batch)
    jax.block_until_ready(m)
    self.metrics = m
    return time.perf_counter() - w, time.process_time() - c


class Probe:
  """The n^2 matmul of peak.matmul_probe (two distinct operands; bf16: bf16 x bf16 -> f32) in
  this process."""

  def __init__(self, n=2048, dtype=jnp.float32):
    self.n, self.flops = n, 2.0 * n ** 3
    self.fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    self.a, self.b = jnp.ones((n, n), dtype), jnp.full((n, n), 2.0, dtype)
    self.fn(self.a, self.b).block_until_ready()

  def run(self, reps=2) -> float:
    """The best wall seconds of `reps` matmuls."""
    best = float('inf')
    for _ in range(reps):
      t0 = time.perf_counter()
      self.fn(self.a, self.b).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    return best


def _round_robin(steps: dict, rounds: int) -> dict:
  times = {k: [] for k in steps}
  for _ in range(rounds):  # every variant sees the same background load
    for k, s in steps.items():
      times[k].append(s.run()[0])
  return times


def _peak(smoke: bool) -> dict:
  return {'flops': 1e9} if smoke else dict(peak_lib.cpu_peak())


def bench_mfu(rounds: int, smoke: bool = False) -> dict:
  config = load_config('stdlib_mtp')
  config.model.dtype = 'float32'  # the float32 MFU on every host ('auto' may pick bf16)
  if smoke:
    shrink(config)
  dtype = peak_lib.cpu_dtype(model_args(config).dtype)
  peak = _peak(smoke) if smoke else peak_lib.update_cpu_peak(dtype)  # probes now; keeps the best
  step, probe = Step(config), Probe(64 if smoke else 2048, dtype)
  steps, probes = [], []
  for _ in range(rounds):
    probes.append(probe.run())
    steps.append(step.run()[0])
  profile = step.profile()  # after the timed rounds
  print(step_profile.format_breakdown(profile), file=sys.stderr, flush=True)
  best_step, median_step, best_probe = min(steps), common.median(steps), min(probes)
  if not smoke:  # the rounds' probes are probes of this host too: a higher one raises the peak
    load = common.load_average()[0]
    peak = peak_lib.update_cpu_peak(dtype, measured={
        'flops': probe.flops / best_probe, 'best_by_size': {str(probe.n): probe.flops / best_probe},
        'date': time.strftime('%Y-%m-%dT%H:%M:%S'), 'load_average': [load, load],
        'jax': jax.__version__, 'source': 'train_throughput.py --only mfu rounds'})
  return {
      'config': 'configs/stdlib_mtp.py', 'attention': attn_lib.attention_impl(model_args(config)),
      'compute_dtype': dtype.name,
      'devices': step.devices, 'peak_gflops': peak['flops'] / 1e9,
      'mfu_best_step_over_peak': step.flops / best_step / peak['flops'],
      'mfu_median_step_over_peak': step.flops / median_step / peak['flops'],
      'steps_per_sec_median': 1.0 / median_step,
      'tokens_per_sec_median': step.tokens / median_step,
      'tokens_per_sec_best': step.tokens / best_step,
      'step_time_best_s': best_step, 'step_time_median_s': median_step,
      'batch_size': config.data.batch_size, 'seq_len': config.data.seq_len,
      'model_flops_per_step': step.flops, 'xla_cost_analysis_flops_per_step': step.xla_flops,
      'probe_gflops_best_this_run': probe.flops / best_probe / 1e9,
      'mfu_best_step_over_best_probe_this_run': step.flops / best_step / (probe.flops / best_probe),
      'compile_s': step.compile_s, 'rounds': rounds, 'step_profile': profile,
  }


def maxtext_config(depth: int, remat: str = 'block', smoke: bool = False, **model):
  """MaxText 0.2.5's CPU peer model (its run_peer.sh): 4 layers, d 256, 8 x 32 heads, no
  GQA, MLP 704, V 1024, batch 16 x 256, float32. Its remat_policy=minimal saves the matmul
  outputs without batch dims: this project's remat='block'. MTP weight 0.1 per depth sum,
  as its mtp_loss_scaling_factor (the weight does not change the step's cost)."""
  c = load_config('stdlib_mtp')
  m = c.model
  m.n_heads = m.n_kv_heads = 8
  m.head_dim, m.mlp_dim, m.vocab_size, m.remat = 32, 704, 1024, remat
  m.mtp.depth = depth
  m.mtp.lambda_values, m.mtp.lambda_boundaries = (0.1,), ()
  c.data.batch_size, c.data.seq_len = 16, 256
  if smoke:
    shrink(c)
  for k, v in model.items():
    setattr(m, k, v)
  return c


def named_config(name: str, smoke: bool = False):
  """'stdlib_mtp' or 'maxtext_M<depth>' (host_malloc.py's --configs)."""
  if name == 'stdlib_mtp':
    c = load_config('stdlib_mtp')
    return shrink(c) if smoke else c
  if name.startswith('maxtext_M') and name[9:].isdigit():
    return maxtext_config(int(name[9:]), smoke=smoke)
  raise ValueError(f'unknown config name {name!r}')


def bench_maxtext(rounds: int, depths=(0, 1, 3), remat: str = 'block', smoke: bool = False) -> dict:
  peak = _peak(smoke)
  steps = {d: Step(maxtext_config(d, remat, smoke)) for d in depths}
  times = _round_robin(steps, rounds)
  out = {'model': 'MaxText CPU peer shape: 4 layers, d 256, 8x32 heads, MLP 704, V 1024, '
                  f'B 16 x T 256, float32, remat={remat}' + (' (smoke: shrunk)' if smoke else ''),
         'attention': attn_lib.attention_impl(model_args(maxtext_config(0, remat, smoke))),
         'devices': STEP_DEVICES, 'peak_gflops': peak['flops'] / 1e9, 'depths': {}}
  for d, s in steps.items():
    med, best = common.median(times[d]), min(times[d])
    out['depths'][str(d)] = {
        'step_time_median_s': med, 'step_time_best_s': best,
        'tokens_per_sec_median': s.tokens / med, 'tokens_per_sec_best': s.tokens / best,
        'model_gflops_per_step': s.flops / 1e9,
        'mfu_best_step_over_peak': s.flops / best / peak['flops'], 'compile_s': s.compile_s}
  return out


def _stdlib(**model):
  c = load_config('stdlib_mtp')
  for k, v in model.items():
    setattr(c.model, k, v)
  return c


def _d768(**model):
  """stdlib_mtp widened to d 768 / 12 layers (6 x 128 heads, MLP 2048), batch 4 x 256."""
  c = _stdlib(d_model=768, n_layers=12, n_heads=6, n_kv_heads=6, mlp_dim=2048, **model)
  c.data.batch_size = 4
  return c


# --ab_set NAME: {model: (config builder, {variant: overrides})}; an override is a
# model.* field of the config, or 'devices' (the CPU devices the step trains on).
AB_SETS = {
    'attention': {  # model.attention_core: the blocked core (CPU default) vs the library call
        'stdlib_mtp': (_stdlib, {'xla': {'attention_core': 'xla'},
                                 'blocked': {'attention_core': 'blocked'}}),
        'maxtext_M1': (lambda **m: maxtext_config(1, **m),
                       {'xla': {'attention_core': 'xla'},
                        'blocked': {'attention_core': 'blocked'}}),
    },
    'blocks': {  # model.attention_block on both shapes
        'stdlib_mtp': (_stdlib, {'block64': {'attention_block': 64},
                                 'block128': {'attention_block': 128}}),
        'maxtext_M3': (lambda **m: maxtext_config(3, **m),
                       {'block64': {'attention_block': 64}, 'block32': {'attention_block': 32},
                        'block128': {'attention_block': 128}}),
    },
    'remat': {  # model.remat on the MaxText shape (block is MaxText's 'minimal')
        'maxtext_M3': (lambda **m: maxtext_config(3, **m),
                       {'block': {'remat': 'block'}, 'none': {'remat': 'none'}}),
    },
    'dtype': {  # model.dtype: float32 against bfloat16 (model/matmul.py's bf16-kernel form)
        'stdlib_mtp': (_stdlib, {'float32': {'dtype': 'float32'},
                                 'bfloat16': {'dtype': 'bfloat16'}}),
        'd768_L12': (_d768, {'float32': {'dtype': 'float32'}, 'bfloat16': {'dtype': 'bfloat16'}}),
    },
    'devices': {  # one CPU device against two (data parallel, the trainer's auto)
        'stdlib_mtp': (_stdlib, {'one_device': {'devices': 1}, 'two_devices': {'devices': 2}}),
        'maxtext_M3': (lambda **m: maxtext_config(3, **m),
                       {'one_device': {'devices': 1}, 'two_devices': {'devices': 2}}),
    },
}


def bench_ab(rounds: int, ab_set: str, smoke: bool = False, only_models=()) -> dict:
  out = {'ab_set': ab_set, 'models': {}}
  models = AB_SETS[ab_set]
  if only_models:
    models = {k: v for k, v in models.items() if k in only_models}
  if smoke:  # the first model only
    models = dict(list(models.items())[:1])
  for name, (build, variants) in models.items():
    steps = {}
    for v, over in variants.items():
      over = dict(over)
      devices = over.pop('devices', None)
      c = build(**over)
      if smoke:
        shrink(c)
        for k, x in over.items():
          setattr(c.model, k, x)
        devices = min(devices or 1, len(jax.devices()))
      steps[v] = Step(c, devices)
    times = _round_robin(steps, rounds)
    # after the timed rounds: one traced step of each variant, its time by op kind
    profiles = {v: s.profile() for v, s in steps.items()}
    for v, prof in profiles.items():
      print(f'{name} {v}: {step_profile.format_breakdown(prof)}', file=sys.stderr, flush=True)
    base = next(iter(variants))
    out['models'][name] = {v: {
        'overrides': {k: str(x) for k, x in variants[v].items()},
        'step_time_best_s': min(times[v]), 'step_time_median_s': common.median(times[v]),
        f'time_ratio_vs_{base}_median': common.median(
            [t / t0 for t, t0 in zip(times[v], times[base])]),
        'tokens_per_sec_median': steps[v].tokens / common.median(times[v]),
        'temp_MiB': steps[v].temp_mib, 'first_step': steps[v].first,
        'compute_dtype': steps[v].dtype.name,
        'mfu_median_over_dtype_peak': steps[v].flops / common.median(times[v]) / (
            1e9 if smoke else peak_lib.cpu_peak(steps[v].dtype)['flops']),
        'matmul_flops_by_dot_form': steps[v].dot_forms,
        'step_profile': profiles[v],
        'first_step_rel_diff': {k: abs(x - steps[base].first[k]) / abs(steps[base].first[k])
                                for k, x in steps[v].first.items()}} for v in variants}
  return out


def bench_overhead(rounds: int, smoke: bool = False) -> dict:
  steps = {}
  for depth in ((0, 1) if smoke else (0, 1, 2, 3)):
    c = load_config('stdlib_mtp')
    if smoke:
      shrink(c)
    c.model.mtp.depth = depth
    c.model.mtp.lambda_values, c.model.mtp.lambda_boundaries = (0.3,), ()
    steps[depth] = Step(c)
  times = _round_robin(steps, rounds)
  out = {'config': 'configs/stdlib_mtp.py with model.mtp.depth = D', 'depths': {}}
  for d, s in steps.items():
    flop_ratio = s.flops / steps[0].flops
    row = {'step_time_best_s': min(times[d]), 'flop_ratio': flop_ratio}
    if d:
      r = common.median([t / t0 for t, t0 in zip(times[d], times[0])])
      row.update({'time_ratio_median': r, 'time_ratio_of_best': min(times[d]) / min(times[0]),
                  'time_ratio_over_flop_ratio': r / flop_ratio})
    out['depths'][str(d)] = row
  return out


def moe_variants(smoke: bool = False) -> dict:
  """configs/dsv3_mini.py and controls with the same active FLOPs per token: a dense SwiGLU
  of width moe_intermediate_size x (K + shared) in place of each MoE layer, and 4x the
  routed experts at the same K; both MoE models also with the 'ragged' dispatch."""
  def build(**over):
    c = load_config('dsv3_mini')
    if smoke:
      shrink(c)
    for path, v in over.items():
      node, *keys = c, *path.split('.')
      for k in keys[:-1]:
        node = node[k]
      node[keys[-1]] = v
    return c
  mo = build().model.moe
  active = mo.moe_intermediate_size * (mo.num_experts_per_tok + mo.n_shared_experts)
  more = {'model.moe.n_routed_experts': 4 * mo.n_routed_experts}
  return {'dense_same_active': build(**{'model.mlp': 'dense', 'model.mlp_dim': active}),
          'dsv3_mini': build(),
          'moe_4x_experts': build(**more),
          'dsv3_mini_ragged': build(**{'model.moe.dispatch': 'ragged'}),
          'moe_4x_experts_ragged': build(**more, **{'model.moe.dispatch': 'ragged'})}


def bench_moe(rounds: int, smoke: bool = False) -> dict:
  """dsv3_mini's step: tokens/s, MFU over the peak counting the active parameters only
  (flops.py), and the dispatch overhead: time ratio to the dense control over FLOP ratio."""
  peak = _peak(smoke)
  variants = moe_variants(smoke)
  if smoke:  # the control and the MoE model: the code path of every variant
    variants = {k: variants[k] for k in ('dense_same_active', 'dsv3_mini')}
  steps = {name: Step(c) for name, c in variants.items()}
  times = _round_robin(steps, rounds)
  base = 'dense_same_active'
  out = {'config': 'configs/dsv3_mini.py', 'peak_gflops': peak['flops'] / 1e9,
         'rounds': rounds, 'variants': {}}
  for name, st in steps.items():
    ratio = common.median([t / t0 for t, t0 in zip(times[name], times[base])])
    flop_ratio = st.flops / steps[base].flops
    med = common.median(times[name])
    out['variants'][name] = {
        'step_time_best_s': min(times[name]), 'step_time_median_s': med,
        'tokens_per_sec_median': st.tokens / med,
        'mfu_best_step_over_peak': st.flops / min(times[name]) / peak['flops'],
        'model_flops_per_step': st.flops, 'flop_ratio_vs_dense': flop_ratio,
        'time_ratio_vs_dense_median': ratio,
        'dispatch_overhead_time_over_flop_ratio': ratio / flop_ratio}
  return out


def memory_config(depth: int, loss_chunk: int, remat: str, scan: bool, smoke: bool = False):
  c = load_config('stdlib_mtp')
  if smoke:
    shrink(c)
  else:
    c.model.vocab_size, c.data.seq_len, c.data.batch_size = 32768, 1024, 8
  c.model.mtp.depth = depth
  c.model.mtp.lambda_values, c.model.mtp.lambda_boundaries = (0.3,), ()
  c.model.loss_chunk = min(loss_chunk, c.data.seq_len)
  c.model.remat, c.model.scan_layers = remat, scan
  return c


def compiled_temp_mib(config) -> float:
  """XLA's temporary memory of the compiled train step (compiled, never run), one device."""
  ts, state = steps_lib.setup(config, jax.devices()[:1])
  with sharding.use_mesh(ts.mesh, ts.rules):
    batch = sharding.host_batch_to_global(synthetic_batch(
        config.data.batch_size, config.data.seq_len, model_args(config).vocab_size), ts.mesh)
    mem = ts.train_step.lower(state, batch).compile().memory_analysis()
  return mem.temp_size_in_bytes / 2**20


# (loss_chunk, remat, scan_layers); the last two are the memory-lean settings.
MEMORY_ROWS = [(0, 'none', False), (256, 'none', False), (256, 'full', False),
               (256, 'block', True), (256, 'full', True)]
MEMORY_AWARE_FLAG = '--xla_cpu_enable_concurrency_optimized_scheduler=false'


def bench_memory(rows=MEMORY_ROWS, smoke: bool = False) -> dict:
  out = {'setup': 'stdlib_mtp model (d 256, 4 layers, 2 x 128 heads), vocab 32768, T 1024, '
                  'batch 8, float32; one depth of logits = 1.00 GiB',
         'xla_flags': os.environ.get('XLA_FLAGS', ''), 'runs': []}
  for loss_chunk, remat, scan in rows:
    row = {'loss_chunk': loss_chunk, 'remat': remat, 'scan_layers': scan}
    for depth in (1, 4):
      row[f'depth{depth}_temp_MiB'] = compiled_temp_mib(
          memory_config(depth, loss_chunk, remat, scan, smoke))
    row['temp_ratio_depth4_over_depth1'] = row['depth4_temp_MiB'] / row['depth1_temp_MiB']
    out['runs'].append(row)
  return out


MEMORY_CHILD = r'''
import common
import train_throughput as tt
common.emit(tt.bench_memory(tt.MEMORY_ROWS[-2:], smoke=%(smoke)r))
'''


def bench_memory_both_schedulers(smoke: bool = False) -> dict:
  """XLA:CPU's default (concurrency-optimised) scheduler, then, in a child process (a
  process-wide flag), its memory-aware one; --smoke: one row, the default scheduler only."""
  if smoke:
    return {'default_cpu_scheduler': bench_memory(MEMORY_ROWS[-1:], smoke=True)}
  env = dict(os.environ, XLA_FLAGS=MEMORY_AWARE_FLAG)
  return {'default_cpu_scheduler': bench_memory(),
          'memory_aware_cpu_scheduler': common.run_child(MEMORY_CHILD % {'smoke': False}, env)}


def bench_compile(smoke: bool = False) -> dict:
  tiny = load_config('tiny')
  tiny.model.vocab_size = 320  # no tokenizer needed
  out = {'tiny': Step(shrink(tiny) if smoke else tiny).compile_s}
  for scan in ((True,) if smoke else (False, True)):
    c = load_config('stdlib_mtp')
    if smoke:
      shrink(c)
    c.model.n_layers, c.model.scan_layers = (2 if smoke else 12), scan
    out[f'{c.model.n_layers}_layers_scan_{scan}'] = Step(c).compile_s
  return out


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--only', default='mfu,overhead,memory,compile',
                 help=f'sections, comma-separated, of {", ".join(SECTIONS)}')
  p.add_argument('--rounds', type=int, default=10, help='timed steps of each variant')
  p.add_argument('--depths', default='0,1,3', help='maxtext section: MTP depths')
  p.add_argument('--remat', default='block', help='maxtext section: model.remat')
  p.add_argument('--ab_set', default='attention', choices=tuple(AB_SETS),
                 help='ab section: the variants (AB_SETS)')
  p.add_argument('--ab_models', default='',
                 help='ab section: only these models of the set, comma-separated (default: all)')
  p.add_argument('--cpu_devices', default='auto',
                 help="CPU devices per train step (data parallel): auto = the trainer's rule, "
                      'or a number')
  p.add_argument('--host_malloc', default='auto', choices=host_memory.MODES,
                 help="the C allocator's handling of freed XLA buffers, as the trainer's "
                      '--host_malloc (read before JAX starts)')
  args = p.parse_args(argv)
  args.only = [s for s in args.only.split(',') if s]
  args.ab_models = tuple(m for m in args.ab_models.split(',') if m)
  known = {m for models in AB_SETS.values() for m in models}
  if set(args.ab_models) - known:
    p.error(f'--ab_models must name models of {", ".join(sorted(known))}, '
            f'got {", ".join(sorted(set(args.ab_models) - known))}')
  bad = [s for s in args.only if s not in SECTIONS]
  if bad or not args.only:
    p.error(f'--only must name some of {", ".join(SECTIONS)}, got {bad or "nothing"}')
  try:
    args.depths = tuple(int(d) for d in args.depths.split(','))
  except ValueError:
    p.error(f'--depths must be comma-separated integers, got {args.depths!r}')
  if args.rounds < 1:
    p.error('--rounds must be >= 1')
  if args.smoke:
    args.rounds, args.depths = 1, args.depths[:1]
  return args


def main(argv=None) -> int:
  args = parse(argv)
  global STEP_DEVICES  # pylint: disable=global-statement
  if args.smoke:  # in the caller's process: its devices and compilation cache as they are
    STEP_DEVICES = 1
  else:
    try:
      n = distributed.resolve_cpu_devices(args.cpu_devices)  # before JAX starts a backend
    except ValueError as e:
      print(f'error: {e}', file=sys.stderr)
      return 2
    if n:
      jax.config.update('jax_num_cpu_devices', n)
    STEP_DEVICES = n or 1
    jax.config.update('jax_enable_compilation_cache', False)  # compile times must be real
  # One section alone records under its own result's name; an A/B set under train_<set>.
  only = args.only[0] if len(args.only) == 1 else None
  name = NAME
  if only:
    name = f'train_{args.ab_set}' if only == 'ab' else RESULT_NAMES.get(only, NAME)
  run = common.start(args, name, argv, script=f'benchmarks/{NAME}.py')
  run.note = NOTE
  r, smoke = args.rounds, args.smoke
  result = {'step_devices': STEP_DEVICES, 'cpu_devices_flag': args.cpu_devices,
            'host_malloc': HOST_MALLOC, 'sections': {}}
  for name in args.only:
    t0 = time.time()
    result['sections'][name] = {
        'mfu': lambda: bench_mfu(r, smoke), 'overhead': lambda: bench_overhead(r, smoke),
        'moe': lambda: bench_moe(r, smoke),
        'maxtext': lambda: bench_maxtext(r, args.depths, args.remat, smoke),
        'memory': lambda: bench_memory_both_schedulers(smoke),
        'compile': lambda: bench_compile(smoke),
        'ab': lambda: bench_ab(r, args.ab_set, smoke, args.ab_models)}[name]()
    result['sections'][name]['bench_seconds'] = time.time() - t0
    print(name, 'done in', f'{time.time() - t0:.0f} s', file=sys.stderr, flush=True)
  common.write(run, result)
  return 0


if __name__ == '__main__':
  sys.exit(main())
