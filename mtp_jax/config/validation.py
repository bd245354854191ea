"""validate(): every field that could fail later, checked before anything compiles, one
function per section of the config; each refusal is a one-line ConfigError naming the field."""
from __future__ import annotations

import math

import mtp_jax.config.kinds as kinds
from mtp_jax.config.base import REMAT_POLICIES
from mtp_jax.config.kernel_limits import ATTENTION_CORES, attention_kernel_problem
from mtp_jax.config.kinds import (
  ATTENTION,
  ATTENTION_KINDS,
  DATA,
  DATA_SOURCES,
  MLP_KINDS,
  MTP_HEADS,
)
from mtp_jax.config.mesh import MESH_AXES, mesh_axes_form, resolved_mesh_axes
from mtp_jax.config.readers import decode_prompt_len, optional, profile_window
from mtp_jax.config.schema import check_schema, either, require, require_positive_int


def _attention_facts(m) -> list[kinds.AttentionFacts]:
  """The facts of the trunk's and the MTP blocks' attention kinds; a name no kind has is
  left out here and refused by _validate_block_kinds."""
  names = sorted({m.attention, m.mtp.block_attention or m.attention})
  return [ATTENTION[k] for k in names if k in ATTENTION]


def _attention_head_width(m) -> int:
  """The widest query/key head of the trunk's and the MTP blocks' attention kinds."""
  view = kinds.args_view(m)
  return max((f.head_widths(view)[0] for f in _attention_facts(m)), default=m.head_dim)


def validate(config, num_devices: int | None = None) -> None:
  """Checks every field that could fail later, before anything compiles: the sizes first
  (later checks divide by them), then section by section.

  Without num_devices it checks every value that does not depend on the devices, and
  needs nothing but this module: the commands run it before JAX starts, so a bad value is
  answered in a second; with num_devices it adds the divisibility of the mesh.
  """
  check_schema(config)
  _validate_sizes(config)
  _validate_model(config)
  _validate_mtp(config)
  _validate_loss(config)
  _validate_train(config)
  _validate_data(config)
  _validate_mesh(config, num_devices)


def _validate_sizes(config) -> None:
  """The widths, lengths and counts that must be positive integers."""
  m, d, t = config.model, config.data, config.train
  for name, val in [('model.d_model', m.d_model), ('model.n_layers', m.n_layers),
                    ('model.n_heads', m.n_heads), ('model.n_kv_heads', m.n_kv_heads),
                    ('model.head_dim', m.head_dim), ('model.mlp_dim', m.mlp_dim),
                    ('data.seq_len', d.seq_len), ('data.batch_size', d.batch_size),
                    ('train.steps', t.steps), ('train.grad_accum', t.grad_accum),
                    ('train.log_every', t.log_every), ('train.eval_batches', t.eval_batches),
                    ('model.vocab_multiple', m.vocab_multiple)]:
    require_positive_int(name, val)


def _validate_model(config) -> None:
  """config.model outside its mtp / mla / moe sub-sections."""
  m, d = config.model, config.data
  require(m.vocab_size >= 0, f'model.vocab_size must be >= 0, got {m.vocab_size}')
  require(m.n_heads % m.n_kv_heads == 0,
           f'model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})')
  require(m.head_dim % 2 == 0, f'model.head_dim must be even for RoPE, got {m.head_dim}')
  require(m.dtype in ('auto', 'float32', 'bfloat16', 'float16'),
           f"model.dtype must be auto, float32, bfloat16 or float16, got {m.dtype!r}")
  require(m.get('dtype_requested', '') in ('', 'auto', 'float32', 'bfloat16', 'float16'),
          'model.dtype_requested must be empty, auto, float32, bfloat16 or float16, got '
          f"{m.get('dtype_requested')!r}")
  require(m.remat in REMAT_POLICIES,
           f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {m.remat!r}")
  require(m.attention_core in ATTENTION_CORES,
           f"model.attention_core must be one of {', '.join(ATTENTION_CORES)}, "
           f"got {m.attention_core!r}")
  for name in ('attention_block', 'attention_block_q', 'attention_block_kv'):
    require(isinstance(m[name], int) and not isinstance(m[name], bool) and m[name] > 0,
             f'model.{name} must be a positive integer, got {m[name]!r}')
  problem = attention_kernel_problem(m.attention_core, d.seq_len, m.attention_block_q,
                                     m.attention_block_kv, _attention_head_width(m))
  require(not problem, problem)
  require(isinstance(m.scan_layers, bool),
           f'model.scan_layers must be True or False, got {m.scan_layers!r}')
  require(m.loss_chunk >= 0 and (m.loss_chunk == 0 or d.seq_len % m.loss_chunk == 0),
           f'model.loss_chunk ({m.loss_chunk}) must be 0 or divide data.seq_len ({d.seq_len})')
  require(m.norm_eps > 0, f'model.norm_eps must be > 0, got {m.norm_eps}')
  require(m.rope_theta > 0, f'model.rope_theta must be > 0, got {m.rope_theta}')
  _validate_rope_scaling(m.rope_scaling)
  unscaled = [f.label for f in _attention_facts(m) if not f.takes_rope_scaling]
  scaled = [f.label for f in ATTENTION.values() if f.takes_rope_scaling]
  require(not m.rope_scaling.kind or not unscaled,
           f"model.rope_scaling applies to {' or '.join(scaled)} attention only "
           f"({' and '.join(unscaled)} blocks keep unscaled RoPE)")
  require(isinstance(m.max_positions, int) and m.max_positions >= 0,
           f'model.max_positions must be a non-negative integer, got {m.max_positions!r}')
  require(not m.max_positions or d.seq_len <= m.max_positions,
           f'data.seq_len ({d.seq_len}) exceeds model.max_positions ({m.max_positions}), '
           'the positions the model supports')
  biased = [k for k, f in ATTENTION.items() if f.takes_qkv_bias]
  require(not m.attention_bias or m.attention not in ATTENTION or m.attention in biased,
           f'model.attention_bias applies to model.attention={either(biased)} only')


def _validate_mtp(config) -> None:
  """config.model.mtp, and the block kinds with their mla / moe sub-sections."""
  mtp, d = config.model.mtp, config.data
  require(isinstance(mtp.depth, int) and mtp.depth >= 0,
           f'model.mtp.depth must be a non-negative integer, got {mtp.depth!r}')
  require(mtp.depth + 1 < d.seq_len,
           f'model.mtp.depth ({mtp.depth}) must be smaller than data.seq_len - 1 '
           f'({d.seq_len - 1}): depth k predicts t_(i+k+1) inside the sequence')
  require(mtp.kind in MTP_HEADS,
           f'model.mtp.kind must be {either(tuple(MTP_HEADS))}, got {mtp.kind!r}')
  _validate_head(config, MTP_HEADS[mtp.kind])
  _validate_mtp_schedules(config)
  for name in ('detach_trunk', 'stop_gradient', 'freeze_trunk'):
    require(isinstance(mtp[name], bool),
             f'model.mtp.{name} must be True or False, got {mtp[name]!r}')
  _validate_shared_modules(config)
  require(not mtp.freeze_trunk or mtp.depth > 0,
           'model.mtp.freeze_trunk trains only the MTP modules, but model.mtp.depth is 0: '
           'set model.mtp.depth >= 1')
  _validate_block_kinds(config)
  if mtp.weights:
    require(len(mtp.weights) == mtp.depth,
             f'model.mtp.weights has {len(mtp.weights)} entries but model.mtp.depth is {mtp.depth}')
    require(all(w >= 0 for w in mtp.weights), f'model.mtp.weights must be >= 0, got {mtp.weights}')


def _validate_shared_modules(config) -> None:
  """model.mtp.share_modules and model.mtp.strict_leaps (one-line errors)."""
  mtp = config.model.mtp
  share = optional(config, 'model.mtp.share_modules', False)
  for name, value in (('share_modules', share),
                      ('strict_leaps', optional(config, 'model.mtp.strict_leaps', False))):
    require(isinstance(value, bool), f'model.mtp.{name} must be True or False, got {value!r}')
  if not share:
    return
  shared = [k for k, facts in MTP_HEADS.items() if facts.shares_modules]
  require(MTP_HEADS[mtp.kind].shares_modules,
          f'model.mtp.share_modules reuses one chained module at every depth: it needs '
          f"model.mtp.kind {' or '.join(map(repr, shared))}, got {mtp.kind!r}")
  require(mtp.depth >= 2, 'model.mtp.share_modules needs model.mtp.depth >= 2 (one depth '
          f'has nothing to share), got {mtp.depth!r}')
  mlp = mtp.block_mlp or (config.model.mlp if config.model.mlp != 'moe'
                          or config.model.n_layers >= config.model.moe.first_k_dense
                          else 'dense')
  require(mlp != 'moe', 'model.mtp.share_modules needs a dense MTP block: an MoE block\'s '
          "routing statistics are per call (set model.mtp.block_mlp = 'dense')")


def _validate_head(config, head: kinds.HeadFacts) -> None:
  """What model.mtp.kind's facts allow: its most depths and, for a head that predicts no
  single token (TOP ranks them), data targets and no leaps."""
  mtp = config.model.mtp
  kind = mtp.kind
  require(not head.max_depth or mtp.depth <= head.max_depth,
          f'model.mtp.kind {kind!r} takes at most {head.max_depth} heads: model.mtp.depth '
          f'must be {head.max_depth} (or less), got {mtp.depth!r}')
  if head.predicts_tokens:
    return
  window = optional(config, 'model.mtp.top_window', 16)  # the ranking's window
  require(isinstance(window, int) and not isinstance(window, bool) and window >= 1,
          f'model.mtp.top_window must be a positive integer, got {window!r}')
  require(not tuple(mtp.target_offsets),
          f'model.mtp.target_offsets do not apply to model.mtp.kind {kind!r} (its target is '
          'not one token at an offset): leave them ()')
  require(config.loss.mtp_targets == 'data',
          f'loss.mtp_targets={config.loss.mtp_targets!r} needs a next-token MTP head; '
          f"model.mtp.kind {kind!r} is trained on the data's tokens: use 'data'")
  require(not mtp.stop_gradient and not optional(config, 'model.mtp.freeze_trunk', False),
          f'model.mtp.kind {kind!r} is an auxiliary loss on the trunk: model.mtp.stop_gradient '
          'and model.mtp.freeze_trunk would leave it nothing to train but its own head')


def _validate_loss(config) -> None:
  """config.loss."""
  mtp = config.model.mtp
  require(config.loss.mtp_targets in ('data', 'self', 'soft'),
           "loss.mtp_targets must be 'data', 'self' or 'soft', got "
           f'{config.loss.mtp_targets!r}')
  require(config.loss.mtp_targets == 'data' or mtp.depth > 0,
           f'loss.mtp_targets={config.loss.mtp_targets!r} sets the targets of MTP depths, '
           'but model.mtp.depth is 0')


def _validate_train(config) -> None:
  """config.train."""
  d, t = config.data, config.train
  require(t.lr > 0, f'train.lr must be > 0, got {t.lr}')
  require(0 <= t.warmup_steps, f'train.warmup_steps must be >= 0, got {t.warmup_steps}')
  require(0 <= t.min_lr_ratio <= 1, f'train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}')
  require(t.weight_decay >= 0, f'train.weight_decay must be >= 0, got {t.weight_decay}')
  require(0 <= t.b1 < 1 and 0 <= t.b2 < 1, f'train.b1/b2 must be in [0, 1), got {t.b1}, {t.b2}')
  require(t.grad_clip >= 0, f'train.grad_clip must be >= 0, got {t.grad_clip}')
  require(t.eval_every >= 0 and t.checkpoint_every >= 0,
           'train.eval_every and train.checkpoint_every must be >= 0')
  for name in ('eval_decode_prompts', 'eval_decode_tokens'):
    require(isinstance(t[name], int) and not isinstance(t[name], bool) and t[name] >= 0,
             f'train.{name} must be a non-negative integer, got {t[name]!r}')
  if t.eval_decode_prompts:  # prompt + generated tokens stay inside the trained positions
    room = d.seq_len - decode_prompt_len(config)
    require(0 < t.eval_decode_tokens <= room,
             f'train.eval_decode_tokens must be in [1, {room}] (data.seq_len minus the '
             f'{decode_prompt_len(config)}-token prompts), got {t.eval_decode_tokens}')
  require(t.max_to_keep >= 1, f'train.max_to_keep must be >= 1, got {t.max_to_keep}')
  require(t.nonfinite in ('halt', 'skip'),
           f"train.nonfinite must be 'halt' or 'skip', got {t.nonfinite!r}")
  require(isinstance(t.max_consecutive_skips, int) and t.max_consecutive_skips >= 1,
           'train.max_consecutive_skips must be a positive integer, '
           f'got {t.max_consecutive_skips!r}')
  profile_window(config)  # ConfigError on a malformed or unusable train.profile_steps
  require(t.hang_factor >= 0 and t.hang_seconds >= 0 and t.local_checkpoint_every >= 0,
           'train.hang_factor, hang_seconds and local_checkpoint_every must be >= 0')
  require('://' not in str(t.local_checkpoint_dir), 'train.local_checkpoint_dir is a path on this '
           f'host\'s disk, not a URL: {t.local_checkpoint_dir!r}')
  for name in ('compilation_cache_dir', 'checkpoint_dir', 'local_checkpoint_dir'):
    require(isinstance(t[name], str), f'train.{name} must be a path or URL string, '
             f'got {t[name]!r}')
  wandb = optional(config, 'train.wandb', None)
  if wandb is not None:
    require(wandb.mode in ('offline', 'online'),
             f"train.wandb.mode must be 'offline' or 'online', got {wandb.mode!r}")


def _validate_data(config) -> None:
  """config.data."""
  d = config.data
  require(d.tokenizer in ('byte', 'sentencepiece', 'hf'),
           f"data.tokenizer must be 'byte', 'sentencepiece' or 'hf', got {d.tokenizer!r}")
  if d.tokenizer == 'sentencepiece':
    require(bool(d.spm_model),
            'data.spm_model must name a .model file when data.tokenizer is sentencepiece')
  if d.tokenizer == 'hf':
    require(bool(d.hf_tokenizer), 'data.hf_tokenizer must name a directory holding '
             "tokenizer.json when data.tokenizer is 'hf'")
  require(0 < d.validation_percent < 100,
           f'data.validation_percent must be in (0, 100), got {d.validation_percent}')
  require(d.worker_count >= 0, f'data.worker_count must be >= 0, got {d.worker_count}')
  for name in ('read_threads', 'prefetch_buffer'):
    require(isinstance(d[name], int) and not isinstance(d[name], bool) and d[name] >= 0,
             f'data.{name} must be a non-negative integer (0: from the CPU count), '
             f'got {d[name]!r}')
  require(isinstance(d.corpus_dir, str),
          f'data.corpus_dir must be a path string, got {d.corpus_dir!r}')
  validate_data_source(d)


def _validate_mesh(config, num_devices: int | None) -> None:
  """config.mesh, and with a device count the divisibility of the batch, vocabulary,
  heads and experts over it."""
  m, d, t = config.model, config.data, config.train
  sizes = mesh_axes_form(config.mesh)
  stages, micro = sizes['stage'], _pipeline_microbatches(config)
  if stages != 1:
    _validate_pipeline(config, stages, micro)
  for rule in config.mesh.rules:
    require(len(rule) == 2, f'mesh.rules entries must be (logical, mesh_axes) pairs, got {rule!r}')
    axes = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    for a in axes:
      require(a is None or a in MESH_AXES,
               f'mesh.rules maps {rule[0]!r} to unknown mesh axis {a!r}; axes are {MESH_AXES}')
  if num_devices is not None:
    sizes = shape = resolved_mesh_axes(config.mesh, num_devices)
  _validate_context(config, sizes['context'])
  if num_devices is not None:
    batch_ways = shape['data'] * shape['fsdp']
    require(d.batch_size % (batch_ways * t.grad_accum) == 0,
             f'data.batch_size ({d.batch_size}) must be divisible by data x fsdp '
             f'({batch_ways}) x train.grad_accum ({t.grad_accum})')
    if stages > 1:
      require(d.batch_size % (batch_ways * t.grad_accum * micro) == 0,
               f'data.batch_size ({d.batch_size}) must be divisible by data x fsdp '
               f'({batch_ways}) x train.grad_accum ({t.grad_accum}) x the pipeline\'s '
               f'{micro} microbatches (model.pipeline_microbatches)')
    rules = dict((r[0], r[1]) for r in config.mesh.rules)
    vocab_axes = rules.get('vocab')
    vocab_axes = vocab_axes if isinstance(vocab_axes, (tuple, list)) else (vocab_axes,)
    vocab_ways = math.prod(shape[a] for a in vocab_axes if a is not None)
    require(not m.vocab_size or m.vocab_size % vocab_ways == 0,
             f'model.vocab_size ({m.vocab_size}) must be divisible by the mesh axes the '
             f'vocab rule shards over ({vocab_ways} devices)')
    require(m.n_kv_heads % shape['tensor'] == 0 and m.n_heads % shape['tensor'] == 0,
             f'model.n_heads ({m.n_heads}) and n_kv_heads ({m.n_kv_heads}) must be divisible '
             f"by the tensor axis ({shape['tensor']})")
    if 'moe' in (m.mlp, m.mtp.block_mlp):
      axes = dict((r[0], r[1]) for r in config.mesh.rules).get('expert')
      axes = axes if isinstance(axes, (tuple, list)) else (axes,)
      ways = math.prod(shape[a] for a in axes if a is not None)
      require(m.moe.n_routed_experts % ways == 0,
               f'model.moe.n_routed_experts ({m.moe.n_routed_experts}) must be divisible by '
               f'the mesh axes the expert rule shards over ({ways} devices)')


def _validate_context(config, ways: int) -> None:
  """A context axis of `ways` devices (-1: not known yet) splits every sequence into 2 x ways
  chunks, two a shard (model/context.py); the attention kernel and the chunked loss run on
  a shard's T / ways tokens."""
  if ways in (1, -1):
    return
  m, d = config.model, config.data
  require(d.seq_len % (2 * ways) == 0,
           f'data.seq_len ({d.seq_len}) must be divisible by 2 x the context axis '
           f'({2 * ways}): each context shard holds two chunks of every sequence')
  local = d.seq_len // ways
  if m.attention_core == 'splash':
    problem = attention_kernel_problem('splash', local, m.attention_block_q,
                                       m.attention_block_kv, _attention_head_width(m))
    require(not problem, f'{problem} (per context shard: {local} tokens of {d.seq_len})')
  require(m.loss_chunk == 0 or local % m.loss_chunk == 0,
           f'model.loss_chunk ({m.loss_chunk}) must divide the {local} tokens of a context '
           f'shard (data.seq_len {d.seq_len} / context {ways})')


def _pipeline_microbatches(config) -> int:
  """model.pipeline_microbatches, checked; 0 stands for the stage count."""
  n = optional(config, 'model.pipeline_microbatches', 0)
  require(isinstance(n, int) and not isinstance(n, bool) and n >= 0,
          f'model.pipeline_microbatches must be a non-negative integer (0: the stage count), '
          f'got {n!r}')
  return n or mesh_axes_form(config.mesh)['stage']


def staged_layers(m) -> int:
  """The trunk layers the pipeline's stages share out (model/pipeline.py's split_stages):
  those after the dense first layers of an MoE trunk, which run before the pipeline."""
  dense = min(m.moe.first_k_dense, m.n_layers) if m.mlp == 'moe' else 0
  return m.n_layers - dense if dense < m.n_layers else m.n_layers


def _validate_pipeline(config, stages: int, micro: int) -> None:
  """mesh.axes.stage > 1: what the pipeline can take (one line each, before compiling)."""
  m = config.model
  require(stages > 0, f'mesh.axes.stage must be a positive integer (the pipeline stages), '
          f'not {stages}: it is never the axis that takes the remaining devices')
  staged = staged_layers(m)
  dense = m.n_layers - staged
  after = f' after the {dense} dense first layers (model.moe.first_k_dense)' if dense else ''
  require(staged % stages == 0,
          f'model.n_layers: the {staged} layers{after} do not divide into '
          f'mesh.axes.stage = {stages} pipeline stages of equal layer counts')
  core = m.attention_core
  require(core not in ('splash', 'triton'),
          f'model.attention_core {core!r} under mesh.axes.stage = {stages}: the pipeline '
          f'runs the blocked or XLA attention cores (model.attention_core blocked or xla)')


def _validate_mtp_schedules(config) -> None:
  """model.mtp.lambda_* , curriculum and target_offsets (one-line errors)."""
  mtp = config.model.mtp
  kind = optional(config, 'model.mtp.lambda_schedule', 'step')
  require(kind in ('step', 'linear', 'cosine'),
           f"model.mtp.lambda_schedule must be 'step', 'linear' or 'cosine', got {kind!r}")
  lv, lb = tuple(mtp.lambda_values), tuple(mtp.lambda_boundaries)
  if kind == 'step':
    require(len(lv) == len(lb) + 1,
             f'model.mtp.lambda_values needs one more entry than model.mtp.lambda_boundaries '
             f'(got {len(lv)} values, {len(lb)} boundaries)')
    require(all(b > 0 for b in lb), f'model.mtp.lambda_boundaries must be positive and '
             f'increasing, got {lb}')
  else:
    require(len(lv) == len(lb) >= 1,
             f"model.mtp.lambda_schedule {kind!r} needs as many model.mtp.lambda_values as "
             f'model.mtp.lambda_boundaries (the value at each step), got {len(lv)} values, '
             f'{len(lb)} boundaries')
    require(all(b >= 0 for b in lb), f'model.mtp.lambda_boundaries must be >= 0 and '
             f'increasing, got {lb}')
  require(all(b2 > b1 for b1, b2 in zip(lb, lb[1:])),
           f'model.mtp.lambda_boundaries must be increasing, got {lb}')
  require(all(isinstance(b, int) and not isinstance(b, bool) for b in lb),
           f'model.mtp.lambda_boundaries must be integer steps, got {lb}')
  require(all(v >= 0 for v in lv), f'model.mtp.lambda_values must be >= 0, got {lv}')
  cur = optional(config, 'model.mtp.curriculum', 'none')
  require(cur in ('none', 'forward', 'reverse'),
           f"model.mtp.curriculum must be 'none', 'forward' or 'reverse', got {cur!r}")
  phase = optional(config, 'model.mtp.curriculum_phase_steps', 0)
  require(isinstance(phase, int) and not isinstance(phase, bool) and phase >= 0,
           f'model.mtp.curriculum_phase_steps must be a non-negative integer (0: '
           f'train.steps / (M + 1)), got {phase!r}')
  require(cur == 'none' or mtp.depth > 0,
           f'model.mtp.curriculum={cur!r} switches MTP depths on and off, but '
           'model.mtp.depth is 0')
  offsets = tuple(optional(config, 'model.mtp.target_offsets', ()))
  if offsets:
    require(len(offsets) == mtp.depth,
             f'model.mtp.target_offsets has {len(offsets)} entries but model.mtp.depth is '
             f'{mtp.depth}')
    require(all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
             and offsets[0] >= 2 and all(b > a for a, b in zip(offsets, offsets[1:])),
             'model.mtp.target_offsets must be increasing integers >= 2 (depth k predicts '
             f't_(i+o_k); the main head has offset 1), got {offsets}')
    require(offsets[-1] < config.data.seq_len,
             f'model.mtp.target_offsets ({offsets}) must stay below data.seq_len '
             f'({config.data.seq_len})')



def _validate_rope_scaling(rs) -> None:
  require(rs.kind in ('', 'linear', 'llama3'),
           f"model.rope_scaling.kind must be '', 'linear' or 'llama3', got {rs.kind!r}")
  if rs.kind:
    require(rs.factor > 0, f'model.rope_scaling.factor must be > 0, got {rs.factor}')
  if rs.kind == 'llama3':
    require(0 < rs.low_freq_factor < rs.high_freq_factor,
             'model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got '
             f'{rs.low_freq_factor}, {rs.high_freq_factor}')
    require_positive_int('model.rope_scaling.original_max_positions', rs.original_max_positions)



def validate_data_source(d) -> None:
  """data.source / path / extensions / tokens_key values (the data layer reads the disk)."""
  require(d.source in DATA_SOURCES, f'data.source must be one of {DATA_SOURCES}, got {d.source!r}')
  require(isinstance(d.path, str), f'data.path must be a path string, got {d.path!r}')
  takes_path = DATA[d.source].takes_path
  require(not takes_path or bool(d.path),
          f'data.source {d.source!r} reads data.path, which is empty')
  require(takes_path or not d.path,
           f'data.path ({d.path!r}) is read only when data.source is one of '
           f'{tuple(s for s, f in DATA.items() if f.takes_path)}; '
           'set data.source, or data.dataset for a TFDS dataset')
  ext = d.extensions
  require(isinstance(ext, (tuple, list)) and bool(ext)
           and all(isinstance(e, str) and len(e) > 1 and e.startswith('.') and '/' not in e
                   for e in ext),
           "data.extensions must be a non-empty tuple of file-name endings such as "
           f"('.md', '.txt'), got {ext!r}")
  require(isinstance(d.tokens_key, str),
           f'data.tokens_key must be a field name or empty, got {d.tokens_key!r}')
  require(d.source != 'files' or not d.tokens_key,
           f'data.tokens_key ({d.tokens_key!r}) names a field of records, but data.source files '
           'reads plain text files: leave it empty')


def _validate_block_kinds(config) -> None:
  """model.attention / mlp / mla.* / moe.* and model.mtp.block_* (one-line errors)."""
  m, mtp = config.model, config.model.mtp
  require(m.attention in ATTENTION_KINDS,
           f'model.attention must be {either(ATTENTION_KINDS)}, got {m.attention!r}')
  require(m.mlp in MLP_KINDS, f'model.mlp must be {either(MLP_KINDS)}, got {m.mlp!r}')
  require(mtp.block_attention in ('',) + ATTENTION_KINDS,
           f"model.mtp.block_attention must be {either(('',) + ATTENTION_KINDS)}, "
           f'got {mtp.block_attention!r}')
  require(mtp.block_mlp in ('',) + MLP_KINDS,
           f"model.mtp.block_mlp must be {either(('',) + MLP_KINDS)}, got {mtp.block_mlp!r}")
  uses_mla = 'mla' in (m.attention, mtp.block_attention)
  uses_moe = 'moe' in (m.mlp, mtp.block_mlp)
  if uses_mla:
    for name in ('kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'):
      require_positive_int(f'model.mla.{name}', m.mla[name])
    q = m.mla.q_lora_rank
    require(isinstance(q, int) and not isinstance(q, bool) and q >= 0,
             'model.mla.q_lora_rank must be a non-negative integer (0: no query compression), '
             f'got {q!r}')
    require(m.mla.qk_rope_head_dim % 2 == 0,
             f'model.mla.qk_rope_head_dim must be even for RoPE, got {m.mla.qk_rope_head_dim}')
  if uses_moe:
    mo = m.moe
    for name in ('n_routed_experts', 'num_experts_per_tok', 'moe_intermediate_size'):
      require_positive_int(f'model.moe.{name}', mo[name])
    for name in ('n_shared_experts', 'first_k_dense'):
      require(isinstance(mo[name], int) and not isinstance(mo[name], bool) and mo[name] >= 0,
               f'model.moe.{name} must be a non-negative integer, got {mo[name]!r}')
    require(mo.num_experts_per_tok <= mo.n_routed_experts,
             f'model.moe.num_experts_per_tok ({mo.num_experts_per_tok}) must be <= '
             f'model.moe.n_routed_experts ({mo.n_routed_experts})')
    require(mo.first_k_dense <= m.n_layers,
             f'model.moe.first_k_dense ({mo.first_k_dense}) must be <= model.n_layers '
             f'({m.n_layers})')
    g, tg = mo.get('n_group', 1), mo.get('topk_group', 1)
    require(mo.get('dispatch', 'auto') in kinds.MOE_DISPATCHES,
             f'model.moe.dispatch must be {either(kinds.MOE_DISPATCHES)}, '
             f"got {mo.get('dispatch')!r}")
    require(mo.get('exchange', 'all_to_all') in kinds.MOE_EXCHANGES,
             f'model.moe.exchange must be {either(kinds.MOE_EXCHANGES)}, '
             f"got {mo.get('exchange')!r}")
    cf = mo.get('capacity_factor', 0.0)
    require(isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf >= 0,
             f'model.moe.capacity_factor must be a number >= 0 (0: dropless), got {cf!r}')
    require_positive_int('model.moe.n_group', g)
    require_positive_int('model.moe.topk_group', tg)
    require(mo.n_routed_experts % g == 0,
             f'model.moe.n_routed_experts ({mo.n_routed_experts}) must be divisible by '
             f'model.moe.n_group ({g})')
    require(tg <= g, f'model.moe.topk_group ({tg}) must be <= model.moe.n_group ({g})')
    require(g == 1 or tg * (mo.n_routed_experts // g) >= mo.num_experts_per_tok,
             f'model.moe.topk_group ({tg}) groups of {mo.n_routed_experts // g} experts cannot '
             f'hold model.moe.num_experts_per_tok ({mo.num_experts_per_tok})')
    require(mo.routed_scaling_factor > 0,
             f'model.moe.routed_scaling_factor must be > 0, got {mo.routed_scaling_factor}')
    require(mo.bias_update_rate >= 0 and mo.balance_loss_weight >= 0,
             'model.moe.bias_update_rate and model.moe.balance_loss_weight must be >= 0, '
             f'got {mo.bias_update_rate}, {mo.balance_loss_weight}')
    require(not mtp.freeze_trunk or m.mlp != 'moe',
             'model.mtp.freeze_trunk with trunk MoE layers is not supported (their routing '
             'bias would still be updated)')
