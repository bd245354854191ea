"""The base configuration and its validation.

Config files in `configs/` start from `base_config()` and override fields; every
field is documented here once. `validate()` runs before anything is compiled and
raises `ConfigError` naming the offending field.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from typing import Any

import ml_collections

from mtp_jax.errors import ConfigError  # noqa: F401  (config_lib.ConfigError stays importable)

MESH_AXES = ('data', 'fsdp', 'tensor')

# Logical axis -> mesh axis. Layers only ever name logical axes.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),  # activations: batch split over data and fsdp
    ('length', None),  # sequence positions stay whole
    ('act_embed', None),  # activation feature dim (replicated: fsdp gathers params)
    ('act_heads', 'tensor'),  # attention heads of activations
    ('act_mlp', 'tensor'),  # MLP hidden of activations
    ('act_vocab', 'tensor'),  # logits
    ('embed', 'fsdp'),  # parameter model dim, sharded ZeRO-3 style
    ('mlp', 'tensor'),  # parameter MLP hidden dim
    ('heads', 'tensor'),  # query heads
    ('kv_heads', 'tensor'),  # key/value heads
    ('head_dim', None),
    ('vocab', 'tensor'),  # embedding / output head vocab dim
    ('norm', None),  # RMSNorm scales
    ('depth', None),  # stacked MTP depth axis
    ('latent', None),  # MLA's compressed q / kv latent dims
    ('expert', 'data'),  # MoE routed experts: expert parallelism over the data axis
)


def base_config() -> ml_collections.ConfigDict:
  """Every field, with a comment, and defaults for a small CPU model."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds parameter init and dropout-free training RNG

  m = c.model = ml_collections.ConfigDict()
  m.vocab_size = 0  # 0: the tokenizer's size rounded up to vocab_multiple
  m.vocab_multiple = 64  # round the vocab up to this (MXU / matmul friendly)
  m.d_model = 256  # residual stream width d
  m.n_layers = 4  # L trunk blocks
  m.n_heads = 4  # query heads
  m.n_kv_heads = 4  # key/value heads (GQA when < n_heads)
  m.head_dim = 64  # per-head width
  m.mlp_dim = 768  # SwiGLU hidden width
  m.rope_theta = 10000.0  # RoPE base
  m.norm_eps = 1e-6  # RMSNorm epsilon
  m.attention_bias = False  # biases on the q/k/v projections (Qwen2), none on o_proj
  m.max_positions = 0  # positions the model supports (a loaded trunk's); data.seq_len must fit (0: no limit)
  # RoPE frequency scaling, as Hugging Face's rope_scaling / rope_parameters (layers.rope_inv_freq).
  rs = m.rope_scaling = ml_collections.ConfigDict()
  rs.kind = ''  # '' none | linear (positions / factor) | llama3 (Llama 3.1's banded rule)
  rs.factor = 1.0  # linear, llama3: the stretch factor
  rs.low_freq_factor = 1.0  # llama3: wavelengths > original / this are stretched
  rs.high_freq_factor = 4.0  # llama3: wavelengths < original / this are kept
  rs.original_max_positions = 8192  # llama3: the context length before scaling
  m.tie_embeddings = True  # OutHead = Emb^T (False: a separate output kernel)
  # compute dtype (params and optimizer state stay float32): float32 | bfloat16 | float16 |
  # auto (bfloat16 on a CPU whose bf16 dot runs >= 2x its f32 dot, e.g. with AMX; else
  # float32: runtime/peak.py compute_dtype)
  m.dtype = 'auto'
  m.init_std = 0.02  # stddev of the embedding init
  m.remat = 'none'  # rematerialisation per block: none | block (keep matmul outputs) | full (keep block inputs)
  m.scan_layers = False  # lax.scan over stacked trunk layers and MTP depths (compile time, memory; same params)
  m.loss_chunk = 0  # sequence chunk for the vocab projection + CE (0: whole length, all depths in one product)
  m.attention = 'gqa'  # block attention: gqa (grouped-query, n_kv_heads) | mla (model.mla.*)
  # Attention core without a cache (mtp_jax/model/attention.py): auto (blocked on CPU, splash
  # on TPU, triton on GPU) | blocked (plain JAX, skips masked key blocks) | splash (the Pallas
  # TPU splash-attention kernel) | triton (the Pallas GPU flash kernel `mha`), each in Pallas
  # interpret mode off its own backend (on CPU: tests) | xla (jax.nn.dot_product_attention's
  # XLA path: dense T x T scores)
  m.attention_core = 'auto'
  m.attention_block = 64  # query/key block of the blocked core
  m.attention_block_q = 512  # splash: query block (at most data.seq_len, which it must divide)
  m.attention_block_kv = 512  # splash: key/value block (likewise)
  m.mlp = 'dense'  # block MLP: dense (SwiGLU, mlp_dim) | moe (DeepSeekMoE, model.moe.*)

  # Multi-head latent attention (DeepSeek-V2/V3; mtp_jax/model/mla.py), used when attention='mla'.
  # n_heads heads; head_dim and n_kv_heads are unused by MLA blocks.
  mla = m.mla = ml_collections.ConfigDict()
  mla.q_lora_rank = 0  # query latent width (0: no query compression, one q_proj)
  mla.kv_lora_rank = 64  # key/value latent width c_kv (what an MLA cache would hold)
  mla.qk_nope_head_dim = 32  # per-head query/key width without RoPE
  mla.qk_rope_head_dim = 16  # per-head rotary query width; one rotary key shared by all heads
  mla.v_head_dim = 32  # per-head value width

  # DeepSeekMoE (mtp_jax/model/moe.py), used when mlp='moe': shared + sigmoid-routed experts.
  moe = m.moe = ml_collections.ConfigDict()
  moe.n_routed_experts = 8  # E routed experts
  moe.n_shared_experts = 1  # shared experts (one SwiGLU of width moe_intermediate_size x this)
  moe.num_experts_per_tok = 2  # K experts chosen per token (top-k of affinity + bias)
  moe.moe_intermediate_size = 128  # SwiGLU hidden width of each expert
  moe.routed_scaling_factor = 1.0  # gates = this x the top-k affinities normalised to sum 1
  moe.n_group = 1  # node-limited routing: E experts in this many equal groups (1: off) ...
  moe.topk_group = 1  # ... a token's top-k comes from its best this-many groups (DeepSeek-V3: 8, 4)
  moe.dispatch = 'auto'  # grouped matmul: ragged | blocks | gmm (TPU kernel) | auto
  # expert-parallel exchange under a mesh: all_to_all (ragged all-to-all, each row sent once
  # to its expert's device; an all-gather emulation on CPU) | all_gather (every device
  # gathers its expert group's tokens, outputs reduce-scattered back)
  moe.exchange = 'all_to_all'
  moe.capacity_factor = 0.0  # all_to_all receive buffer in mean rows (N K); 0: dropless
  moe.first_k_dense = 1  # the first this many trunk layers keep a dense MLP (mlp_dim)
  moe.bias_update_rate = 1e-3  # gamma of aux-loss-free balancing (0: bias update off)
  moe.balance_loss_weight = 1e-4  # alpha of the sequence-wise balance loss (0: off)

  mtp = m.mtp = ml_collections.ConfigDict()
  mtp.depth = 1  # M, number of MTP depths (0: plain next-token model)
  # sequential (DeepSeek-V3) | parallel (independent heads) | top (token order prediction,
  # Zuhri et al. 2025: one extra unembedding on the trunk's normed h^0, trained with a
  # ListNet ranking loss towards how soon each token next appears within top_window tokens;
  # depth 1 only, weight lambda; it cannot draft)
  mtp.kind = 'sequential'
  mtp.top_window = 16  # top: W, how many upcoming tokens the ranking target looks at
  # lambda(step), w_k = lambda / M. lambda_schedule 'step': piecewise constant, lambda_values
  # has one more entry than lambda_boundaries (the steps where it moves to the next value);
  # 'linear' / 'cosine': lambda_values[j] is the value at step lambda_boundaries[j] (as many
  # of each), interpolated between them (cosine: half a cosine wave), constant outside;
  # DeepSeek-V3's 0.3 -> 0.1 over a run of S steps: values (0.3, 0.1), boundaries (0, S).
  mtp.lambda_schedule = 'step'
  mtp.lambda_values = (0.3,)
  mtp.lambda_boundaries = ()
  mtp.weights = ()  # explicit per-depth weights w_1..w_M, override lambda / M
  # Depth curriculum (Aynetdinov & Akbik 2025), through the loss weights (shapes and the
  # compiled step never change): k_max = M + 1 heads counting the main one, phase P steps;
  # forward: depths 1..min(M, floor(s / P)) are active at step s (next-token only first,
  # then one more depth per phase); reverse: depths 1..max(0, M - floor(s / P)) (all
  # first, the deepest switched off first). An inactive depth has weight 0 and its
  # parameters and Adam moments are not updated. none: every depth, every step.
  mtp.curriculum = 'none'
  mtp.curriculum_phase_steps = 0  # P (0: train.steps / (M + 1), equal phases)
  # Per-depth target offsets o_1..o_M: depth k at position i predicts t_(i+o_k) (leap
  # targets, L-MTP); () = the adjacent targets o_k = k + 1. A sequential depth reads
  # t_(i+o_k-1), the token before its target. Only depths 1..c with o_k = k + 1 can draft
  # (a leap depth cannot propose the next token): the decoder drafts with those.
  mtp.target_offsets = ()
  mtp.detach_trunk = False  # stop_gradient on h^0 only where it enters depth 1 (Emb, OutHead still shared)
  # MTP as a pure add-on during joint training: the MTP losses send no gradient into the
  # trunk's hidden state h^0, the shared Emb (the MTP inputs t_(i+k)) or the shared OutHead;
  # the trunk, Emb and OutHead learn from L_main alone, the MTP modules from their L^k.
  # Forward values (losses, metrics) are unchanged.
  mtp.stop_gradient = False
  # Train only the MTP modules on a trained model (--init_from or this run's checkpoint):
  # trunk, final norm, Emb and OutHead are not in the optimizer (no update, no decay, no Adam
  # moments, no gradient computed) and stay bit-identical. Changes the optimizer state, so
  # a workdir cannot switch it on resume (start a new one with --init_from).
  mtp.freeze_trunk = False
  # The MTP blocks' kinds: '' follows the trunk (attention = model.attention; the MLP is the
  # one trunk layer index n_layers would have, i.e. MoE after model.moe.first_k_dense, as
  # DeepSeek-V3's MTP layer is MLA + MoE); or name one: gqa | mla, dense | moe.
  mtp.block_attention = ''
  mtp.block_mlp = ''

  lo = c.loss = ml_collections.ConfigDict()
  # What MTP depth k at position i is trained to predict: 'data' = the true t_(i+k+1);
  # 'self' = the main model's greedy argmax at position i+k (the token the verifier picks
  # given the true prefix; self-distillation, no gradient through it), on the same valid
  # positions; 'soft' = the main model's whole distribution at i+k (cross-entropy against
  # its softmax, no gradient through it): what speculative *sampling* accepts against, so
  # the drafts for T > 0. train/loss_mtp_k is then the loss against those targets
  # (for 'soft' the KL plus the teacher's entropy); acc_mtp_k and every eval/ figure stay
  # measured against the data.
  lo.mtp_targets = 'data'

  d = c.data = ml_collections.ConfigDict()
  # Where documents come from: tfds (data.dataset by its TFDS name) | files (data.path: a
  # folder, one document per file ending in data.extensions) | jsonl | parquet (data.path: a
  # file or a folder of them, one record per line / row) | hf_disk (data.path: a directory
  # written by datasets' save_to_disk). Records split into train / validation by hash unless
  # a saved DatasetDict names its splits (mtp_jax/data/user_data.py).
  d.source = 'tfds'
  d.path = ''  # data.source files / jsonl / parquet / hf_disk: what to read ('' with tfds)
  d.extensions = ('.py',)  # data.source files: the file-name endings read, e.g. ('.md', '.txt')
  d.tokens_key = ''  # record field of token ids used as stored, instead of tokenizing text_key
  d.dataset = 'python_stdlib'  # TFDS name; python_stdlib is built from this interpreter
  d.data_dir = ''  # TFDS data_dir ('' -> ~/.cache/mtp_jax/tensorflow_datasets)
  d.text_key = 'text'  # record field holding the document text (TFDS feature, JSON key, column)
  d.train_split = 'train'  # TFDS split to train on
  d.eval_split = 'validation'  # TFDS split for evaluation
  d.validation_percent = 5  # python_stdlib: percent of files (by path hash) held out
  d.corpus_dir = ''  # python_stdlib: root of the .py files ('' -> this interpreter's stdlib)
  d.tokenizer = 'byte'  # byte | sentencepiece | hf (a Hugging Face tokenizer.json; --init_from hf:DIR sets it)
  d.spm_model = ''  # path of a SentencePiece .model (scripts/train_tokenizer.py)
  d.hf_tokenizer = ''  # tokenizer=hf: a local directory holding tokenizer.json (and its configs)
  d.seq_len = 256  # tokens per packed sequence T
  d.batch_size = 16  # global batch (sequences per optimizer step)
  d.shuffle_seed = 0  # seed of the document shuffle
  d.worker_count = 0  # grain worker processes (0: in the main process)
  d.read_threads = 0  # threads reading + tokenizing documents (0: from the host's CPU count)
  d.prefetch_buffer = 0  # documents read ahead (0: 32 per read thread)

  t = c.train = ml_collections.ConfigDict()
  t.steps = 1000  # optimizer steps
  t.lr = 3e-3  # peak learning rate
  t.warmup_steps = 100  # linear warmup
  t.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio
  t.weight_decay = 0.1  # AdamW decoupled weight decay
  t.b1 = 0.9  # Adam beta1
  t.b2 = 0.95  # Adam beta2
  t.grad_clip = 1.0  # global-norm clip (0: off)
  t.grad_accum = 1  # microbatches per step (same update as one big batch)
  t.log_every = 10  # steps between metric lines
  t.eval_every = 200  # steps between evaluations (0: only at the end)
  t.eval_batches = 8  # validation batches per evaluation
  t.eval_decode_prompts = 0  # validation prompts decoded (greedy) per eval -> eval/decode_* (0 or mtp.depth 0: off)
  t.eval_decode_tokens = 32  # tokens generated per such prompt; prompts are data.seq_len // 2 tokens
  t.checkpoint_every = 200  # steps between checkpoints (0: only at the end)
  t.max_to_keep = 3  # checkpoints kept
  t.async_checkpoint = True  # save in a background thread
  t.nonfinite = 'halt'  # NaN/Inf loss or grad norm: halt (stop, name step + depth) | skip (drop it)
  t.max_consecutive_skips = 10  # nonfinite=skip: halt after this many non-finite steps in a row
  t.progress = True  # live progress line on the console
  t.profile_steps = ''  # 'A:B': a JAX profiler trace of steps A..B-1 under WORKDIR/profile/
  t.profile_all_processes = False  # profile_steps on every process (default: process 0 only)
  # Persistent XLA compilation cache: a restart of the same config loads its compiled steps
  # instead of compiling again. A local path (~ expanded) or a URL such as gs://bucket/cache
  # (shared by every host of a pod and kept across preemptions); '' turns it off. With this
  # default, $JAX_COMPILATION_CACHE_DIR is used when set (mtp_jax/runtime/compile_cache.py).
  t.compilation_cache_dir = '~/.cache/mtp_jax/jax_cache'
  # Where checkpoints go: '' is WORKDIR/checkpoints; a URL (gs://bucket/run) passes to orbax
  # as it is. The workdir (lock, metrics, TensorBoard, config.json) stays local.
  t.checkpoint_dir = ''
  # Staying alive (mtp_jax/train/watchdog.py, mtp_jax/train/tiers.py): the watchdog dumps every
  # thread's stack when no step finished for hang_factor x the median step or hang_seconds
  # (0: that rule off) and, with hang_exit, exits 124 for a supervisor to restart. Every
  # local_checkpoint_every steps (0: off) a checkpoint also goes to local_checkpoint_dir
  # ('': WORKDIR/local_checkpoints), this host's disk; a restart resumes from the newest tier.
  t.hang_factor = 0.0
  t.hang_seconds = 1800.0
  t.hang_exit = False
  t.local_checkpoint_every = 0
  t.local_checkpoint_dir = ''
  # Weights & Biases (`pip install -e '.[wandb]'`): a project name also logs every metric line
  # to a run of that project; '' is off. mode offline writes it under WORKDIR/wandb for a
  # later `wandb sync` (no network, no account); online sends it as it goes.
  t.wandb = ml_collections.ConfigDict({'project': '', 'mode': 'offline', 'name': ''})

  mesh = c.mesh = ml_collections.ConfigDict()
  mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); one -1 takes the remaining devices
  mesh.rules = DEFAULT_RULES  # logical axis -> mesh axis table
  return c


def decode_prompt_len(config) -> int:
  """Prompt tokens of the decode evaluation: half a training sequence."""
  return config.data.seq_len // 2


def mesh_shape_form(shape) -> tuple[int, ...]:
  """mesh.shape as a tuple of ints, checked without a device count: one entry per mesh
  axis, each positive or a single -1."""
  ok = (isinstance(shape, (tuple, list))
        and all(isinstance(s, int) and not isinstance(s, bool) for s in shape))
  if not ok or len(shape) != len(MESH_AXES):
    raise ConfigError(f'mesh.shape must be {len(MESH_AXES)} integers {MESH_AXES} such as '
                      f'(-1, 1, 1), got {shape!r}')
  shape = tuple(shape)
  if any(s == 0 or s < -1 for s in shape) or shape.count(-1) > 1:
    raise ConfigError(f'mesh.shape entries must be positive or a single -1, got {shape}')
  return shape


def resolved_mesh_shape(shape, num_devices: int) -> tuple[int, ...]:
  """Fills one -1 entry so the product equals num_devices."""
  shape = mesh_shape_form(shape)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if num_devices % known:
      raise ConfigError(
          f'mesh.shape {shape}: {num_devices} devices are not divisible by {known}')
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if math.prod(shape) != num_devices:
    raise ConfigError(
        f'mesh.shape {shape} has {math.prod(shape)} devices but {num_devices} are available')
  return shape


@dataclasses.dataclass(frozen=True)
class AttentionFacts:
  """What the config checks ask of an attention kind, readable before JAX starts. The
  model's class of the same name (mtp.ATTENTION_KINDS) carries the same facts
  (head_widths, takes_rope_scaling, takes_qkv_bias); tests/test_kinds.py holds them equal."""
  label: str  # how messages name it
  qk_head_dim: Callable[[Any], int]  # config.model -> one head's query / key width
  takes_rope_scaling: bool  # its RoPE follows model.rope_scaling
  takes_qkv_bias: bool  # it has model.attention_bias's q/k/v biases


# The kind names a config may use; mtp_jax/model/mtp.py's tables of the same names hold
# the classes (tests/test_kinds.py holds the two equal). The model imports this module,
# never the reverse, so the names are written here too.
ATTENTION_FACTS = {  # model.attention, model.mtp.block_attention
    'gqa': AttentionFacts('GQA', lambda m: m.head_dim, takes_rope_scaling=True,
                          takes_qkv_bias=True),
    'mla': AttentionFacts('MLA', lambda m: m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim,
                          takes_rope_scaling=False, takes_qkv_bias=False),
}
ATTENTION_KINDS = tuple(ATTENTION_FACTS)
MLP_KINDS = ('dense', 'moe')  # model.mlp, model.mtp.block_mlp
MTP_KINDS = ('sequential', 'parallel', 'top')  # model.mtp.kind
MOE_DISPATCHES = ('auto', 'ragged', 'blocks', 'gmm')  # model.moe.dispatch (moe.DISPATCHES)
MOE_EXCHANGES = ('all_to_all', 'all_gather')  # model.moe.exchange (moe_exchange.EXCHANGES)


def _either(names) -> str:
  """The accepted values in a message: 'a', 'b' or 'c'."""
  quoted = [repr(n) for n in names]
  return quoted[0] if len(quoted) == 1 else ', '.join(quoted[:-1]) + ' or ' + quoted[-1]


def _require(cond: bool, msg: str):
  if not cond:
    raise ConfigError(msg)


def require_positive_int(name: str, value) -> None:
  """ConfigError unless `value` is an int (not a bool) > 0; `name` is the dotted field."""
  _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
           f'{name} must be a positive integer, got {value!r}')


def _type_name(v) -> str:
  return {bool: 'a boolean', int: 'an integer', float: 'a number', str: 'a string',
          tuple: 'a tuple', list: 'a tuple'}.get(type(v), type(v).__name__)


def check_schema(config, reference=None, prefix: str = '') -> None:
  """Every field must exist in base_config() and hold a value of its type.

  A config *file* may add fields freely (only command-line overrides are locked), so a
  misspelled `c.train.checkpoint_evry = 10` would otherwise be silently ignored.
  """
  reference = base_config() if reference is None else reference
  for key in config.keys():
    name = f'{prefix}{key}'
    if key not in reference:
      close = difflib.get_close_matches(key, list(reference.keys()), n=1)
      hint = f' (did you mean {prefix}{close[0]}?)' if close else ''
      raise ConfigError(f'unknown config field {name}{hint}')
    value, want = config[key], reference[key]
    if isinstance(want, ml_collections.ConfigDict):
      _require(isinstance(value, ml_collections.ConfigDict),
               f'{name} must be a group of fields, got {value!r}')
      check_schema(value, want, name + '.')
      continue
    _require(_same_kind(value, want), f'{name} must be {_type_name(want)}, got {value!r}')


def _same_kind(value, want) -> bool:
  """value may stand where base_config() has `want` (an int for a float, a list for a tuple)."""
  if isinstance(want, bool):
    return isinstance(value, bool)
  if isinstance(value, bool):
    return False
  if isinstance(want, float):
    return isinstance(value, (int, float))
  if isinstance(want, int):
    return isinstance(value, int)
  if isinstance(want, (tuple, list)):
    return isinstance(value, (tuple, list))
  return isinstance(value, type(want))


ATTENTION_CORES = ('auto', 'blocked', 'splash', 'triton', 'xla')
# The Triton kernel's blocks by padded head width (the next power of two): forward queries x
# keys, then the backward kernels' (dkv: queries x keys, dq: queries x keys), so that the
# tiles fit an H100's shared memory (128 x 128 forward at width 256 asks for 320 KiB of its
# 227). Up to width 128 the backward takes the shapes of Triton's fused-attention tutorial
# (dkv 32 x 128: a key block accumulates over small query blocks; dq 128 x 32), not the
# kernel's 32 x 32 defaults, which re-read q and do four times per key. The dkv key block
# must equal the dq query block (the fused backward splits both lengths alike). Widths past
# the last row were never compiled.
TRITON_BLOCKS = ((128, (128, 128, 32, 128, 128, 32)), (256, (128, 64, 32, 64, 64, 32)),
                 (512, (64, 32, 32, 32, 32, 32)))


def triton_blocks(head_width: int) -> tuple | None:
  """(block_q, block_k, block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq) of the Triton
  kernel for q / k heads this wide (TRITON_BLOCKS), or None."""
  padded = 1 << max(head_width - 1, 0).bit_length()
  return next((blocks for width, blocks in TRITON_BLOCKS if padded <= width), None)


def attention_kernel_problem(core: str, seq_len: int, block_q: int, block_kv: int,
                             head_width: int = 0) -> str:
  """One line saying why attention core `core` cannot take sequences of seq_len with
  these splash blocks and q / k heads head_width wide, or '' when it can ('auto' and the
  non-kernel cores: always '').

  splash: each block (at most T) must divide T and be a multiple of 128, the kernel's
  lane width (its key blocks must be; the query blocks tile the segment-id rows alike).
  triton: T must be a multiple of each of its blocks (at most T); heads up to 512 wide."""
  if core == 'splash':
    for name, block in (('attention_block_q', block_q), ('attention_block_kv', block_kv)):
      b = min(block, seq_len)
      if seq_len % b or b % 128:
        return (f'model.attention_core=splash needs data.seq_len ({seq_len}) to be a multiple '
                f'of model.{name} ({block}) or of 128 if shorter, and that block a multiple '
                'of 128; change data.seq_len or the block, or use attention_core=blocked / xla')
  if core == 'triton':
    blocks = triton_blocks(head_width)
    if blocks is None:
      return (f'model.attention_core=triton takes query/key heads up to {TRITON_BLOCKS[-1][0]} '
              f'wide (the widest compiled for an H100), got {head_width}; use '
              'attention_core=xla')
    for block in blocks:
      if seq_len % min(block, seq_len):
        return (f'model.attention_core=triton needs data.seq_len ({seq_len}) to be a multiple '
                f'of {block} (the Pallas GPU kernel\'s block) when longer; change '
                'data.seq_len or use attention_core=xla')
  return ''


def _attention_facts(m) -> list[AttentionFacts]:
  """The facts of the trunk's and the MTP blocks' attention kinds; a name no kind has is
  left out here and refused by _validate_block_kinds."""
  kinds = sorted({m.attention, m.mtp.block_attention or m.attention})
  return [ATTENTION_FACTS[k] for k in kinds if k in ATTENTION_FACTS]


def _attention_head_width(m) -> int:
  """The widest query/key head of the trunk's and the MTP blocks' attention kinds."""
  return max((f.qk_head_dim(m) for f in _attention_facts(m)), default=m.head_dim)


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
  _require(m.vocab_size >= 0, f'model.vocab_size must be >= 0, got {m.vocab_size}')
  _require(m.n_heads % m.n_kv_heads == 0,
           f'model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})')
  _require(m.head_dim % 2 == 0, f'model.head_dim must be even for RoPE, got {m.head_dim}')
  _require(m.dtype in ('auto', 'float32', 'bfloat16', 'float16'),
           f"model.dtype must be auto, float32, bfloat16 or float16, got {m.dtype!r}")
  _require(m.remat in ('none', 'block', 'full'),
           f"model.remat must be none, block or full, got {m.remat!r}")
  _require(m.attention_core in ATTENTION_CORES,
           f"model.attention_core must be one of {', '.join(ATTENTION_CORES)}, "
           f"got {m.attention_core!r}")
  for name in ('attention_block', 'attention_block_q', 'attention_block_kv'):
    _require(isinstance(m[name], int) and not isinstance(m[name], bool) and m[name] > 0,
             f'model.{name} must be a positive integer, got {m[name]!r}')
  problem = attention_kernel_problem(m.attention_core, d.seq_len, m.attention_block_q,
                                     m.attention_block_kv, _attention_head_width(m))
  _require(not problem, problem)
  _require(isinstance(m.scan_layers, bool),
           f'model.scan_layers must be True or False, got {m.scan_layers!r}')
  _require(m.loss_chunk >= 0 and (m.loss_chunk == 0 or d.seq_len % m.loss_chunk == 0),
           f'model.loss_chunk ({m.loss_chunk}) must be 0 or divide data.seq_len ({d.seq_len})')
  _require(m.norm_eps > 0, f'model.norm_eps must be > 0, got {m.norm_eps}')
  _require(m.rope_theta > 0, f'model.rope_theta must be > 0, got {m.rope_theta}')
  _validate_rope_scaling(m.rope_scaling)
  unscaled = [f.label for f in _attention_facts(m) if not f.takes_rope_scaling]
  scaled = [f.label for f in ATTENTION_FACTS.values() if f.takes_rope_scaling]
  _require(not m.rope_scaling.kind or not unscaled,
           f"model.rope_scaling applies to {' or '.join(scaled)} attention only "
           f"({' and '.join(unscaled)} blocks keep unscaled RoPE)")
  _require(isinstance(m.max_positions, int) and m.max_positions >= 0,
           f'model.max_positions must be a non-negative integer, got {m.max_positions!r}')
  _require(not m.max_positions or d.seq_len <= m.max_positions,
           f'data.seq_len ({d.seq_len}) exceeds model.max_positions ({m.max_positions}), '
           'the positions the model supports')
  biased = [k for k, f in ATTENTION_FACTS.items() if f.takes_qkv_bias]
  _require(not m.attention_bias or m.attention not in ATTENTION_FACTS or m.attention in biased,
           f'model.attention_bias applies to model.attention={_either(biased)} only')


def _validate_mtp(config) -> None:
  """config.model.mtp, and the block kinds with their mla / moe sub-sections."""
  mtp, d = config.model.mtp, config.data
  _require(isinstance(mtp.depth, int) and mtp.depth >= 0,
           f'model.mtp.depth must be a non-negative integer, got {mtp.depth!r}')
  _require(mtp.depth + 1 < d.seq_len,
           f'model.mtp.depth ({mtp.depth}) must be smaller than data.seq_len - 1 '
           f'({d.seq_len - 1}): depth k predicts t_(i+k+1) inside the sequence')
  _require(mtp.kind in MTP_KINDS,
           f'model.mtp.kind must be {_either(MTP_KINDS)}, got {mtp.kind!r}')
  if mtp.kind == 'top':
    _validate_top(config)
  _validate_mtp_schedules(config)
  for name in ('detach_trunk', 'stop_gradient', 'freeze_trunk'):
    _require(isinstance(mtp[name], bool),
             f'model.mtp.{name} must be True or False, got {mtp[name]!r}')
  _require(not mtp.freeze_trunk or mtp.depth > 0,
           'model.mtp.freeze_trunk trains only the MTP modules, but model.mtp.depth is 0: '
           'set model.mtp.depth >= 1')
  _validate_block_kinds(config)
  if mtp.weights:
    _require(len(mtp.weights) == mtp.depth,
             f'model.mtp.weights has {len(mtp.weights)} entries but model.mtp.depth is {mtp.depth}')
    _require(all(w >= 0 for w in mtp.weights), f'model.mtp.weights must be >= 0, got {mtp.weights}')


def _validate_top(config) -> None:
  """model.mtp.kind 'top': one ranking head, so depth 1 (or 0), data targets, no leaps."""
  mtp = config.model.mtp
  window = optional(config, 'model.mtp.top_window', 16)
  _require(mtp.depth in (0, 1), f"model.mtp.kind 'top' is one token-order head: "
           f'model.mtp.depth must be 1 (or 0), got {mtp.depth!r}')
  _require(isinstance(window, int) and not isinstance(window, bool) and window >= 1,
           f'model.mtp.top_window must be a positive integer, got {window!r}')
  _require(not tuple(mtp.target_offsets),
           "model.mtp.target_offsets do not apply to model.mtp.kind 'top' (its target is "
           'the order of the next top_window tokens): leave them ()')
  _require(config.loss.mtp_targets == 'data',
           f"loss.mtp_targets={config.loss.mtp_targets!r} needs a next-token MTP head; "
           "model.mtp.kind 'top' ranks the data's upcoming tokens: use 'data'")
  _require(not mtp.stop_gradient and not optional(config, 'model.mtp.freeze_trunk', False),
           "model.mtp.kind 'top' is an auxiliary loss on the trunk: model.mtp.stop_gradient "
           'and model.mtp.freeze_trunk would leave it nothing to train but its own head')


def _validate_loss(config) -> None:
  """config.loss."""
  mtp = config.model.mtp
  _require(config.loss.mtp_targets in ('data', 'self', 'soft'),
           "loss.mtp_targets must be 'data', 'self' or 'soft', got "
           f'{config.loss.mtp_targets!r}')
  _require(config.loss.mtp_targets == 'data' or mtp.depth > 0,
           f'loss.mtp_targets={config.loss.mtp_targets!r} sets the targets of MTP depths, '
           'but model.mtp.depth is 0')


def _validate_train(config) -> None:
  """config.train."""
  d, t = config.data, config.train
  _require(t.lr > 0, f'train.lr must be > 0, got {t.lr}')
  _require(0 <= t.warmup_steps, f'train.warmup_steps must be >= 0, got {t.warmup_steps}')
  _require(0 <= t.min_lr_ratio <= 1, f'train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}')
  _require(t.weight_decay >= 0, f'train.weight_decay must be >= 0, got {t.weight_decay}')
  _require(0 <= t.b1 < 1 and 0 <= t.b2 < 1, f'train.b1/b2 must be in [0, 1), got {t.b1}, {t.b2}')
  _require(t.grad_clip >= 0, f'train.grad_clip must be >= 0, got {t.grad_clip}')
  _require(t.eval_every >= 0 and t.checkpoint_every >= 0,
           'train.eval_every and train.checkpoint_every must be >= 0')
  for name in ('eval_decode_prompts', 'eval_decode_tokens'):
    _require(isinstance(t[name], int) and not isinstance(t[name], bool) and t[name] >= 0,
             f'train.{name} must be a non-negative integer, got {t[name]!r}')
  if t.eval_decode_prompts:  # prompt + generated tokens stay inside the trained positions
    room = d.seq_len - decode_prompt_len(config)
    _require(0 < t.eval_decode_tokens <= room,
             f'train.eval_decode_tokens must be in [1, {room}] (data.seq_len minus the '
             f'{decode_prompt_len(config)}-token prompts), got {t.eval_decode_tokens}')
  _require(t.max_to_keep >= 1, f'train.max_to_keep must be >= 1, got {t.max_to_keep}')
  _require(t.nonfinite in ('halt', 'skip'),
           f"train.nonfinite must be 'halt' or 'skip', got {t.nonfinite!r}")
  _require(isinstance(t.max_consecutive_skips, int) and t.max_consecutive_skips >= 1,
           'train.max_consecutive_skips must be a positive integer, '
           f'got {t.max_consecutive_skips!r}')
  profile_window(config)  # ConfigError on a malformed or unusable train.profile_steps
  _require(t.hang_factor >= 0 and t.hang_seconds >= 0 and t.local_checkpoint_every >= 0,
           'train.hang_factor, hang_seconds and local_checkpoint_every must be >= 0')
  _require('://' not in str(t.local_checkpoint_dir), 'train.local_checkpoint_dir is a path on this '
           f'host\'s disk, not a URL: {t.local_checkpoint_dir!r}')
  for name in ('compilation_cache_dir', 'checkpoint_dir', 'local_checkpoint_dir'):
    _require(isinstance(t[name], str), f'train.{name} must be a path or URL string, '
             f'got {t[name]!r}')
  wandb = optional(config, 'train.wandb', None)
  if wandb is not None:
    _require(wandb.mode in ('offline', 'online'),
             f"train.wandb.mode must be 'offline' or 'online', got {wandb.mode!r}")


def _validate_data(config) -> None:
  """config.data."""
  d = config.data
  _require(d.tokenizer in ('byte', 'sentencepiece', 'hf'),
           f"data.tokenizer must be 'byte', 'sentencepiece' or 'hf', got {d.tokenizer!r}")
  if d.tokenizer == 'sentencepiece':
    _require(bool(d.spm_model), 'data.spm_model must name a .model file when data.tokenizer is sentencepiece')
  if d.tokenizer == 'hf':
    _require(bool(d.hf_tokenizer), 'data.hf_tokenizer must name a directory holding '
             "tokenizer.json when data.tokenizer is 'hf'")
  _require(0 < d.validation_percent < 100,
           f'data.validation_percent must be in (0, 100), got {d.validation_percent}')
  _require(d.worker_count >= 0, f'data.worker_count must be >= 0, got {d.worker_count}')
  for name in ('read_threads', 'prefetch_buffer'):
    _require(isinstance(d[name], int) and not isinstance(d[name], bool) and d[name] >= 0,
             f'data.{name} must be a non-negative integer (0: from the CPU count), '
             f'got {d[name]!r}')
  _require(isinstance(d.corpus_dir, str), f'data.corpus_dir must be a path string, got {d.corpus_dir!r}')
  validate_data_source(d)


def _validate_mesh(config, num_devices: int | None) -> None:
  """config.mesh, and with a device count the divisibility of the batch, vocabulary,
  heads and experts over it."""
  m, d, t = config.model, config.data, config.train
  mesh_shape_form(config.mesh.shape)
  for rule in config.mesh.rules:
    _require(len(rule) == 2, f'mesh.rules entries must be (logical, mesh_axes) pairs, got {rule!r}')
    axes = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
    for a in axes:
      _require(a is None or a in MESH_AXES,
               f'mesh.rules maps {rule[0]!r} to unknown mesh axis {a!r}; axes are {MESH_AXES}')
  if num_devices is not None:
    shape = resolved_mesh_shape(config.mesh.shape, num_devices)
    batch_ways = shape[0] * shape[1]
    _require(d.batch_size % (batch_ways * t.grad_accum) == 0,
             f'data.batch_size ({d.batch_size}) must be divisible by data x fsdp '
             f'({batch_ways}) x train.grad_accum ({t.grad_accum})')
    rules = dict((r[0], r[1]) for r in config.mesh.rules)
    vocab_axes = rules.get('vocab')
    vocab_axes = vocab_axes if isinstance(vocab_axes, (tuple, list)) else (vocab_axes,)
    vocab_ways = math.prod(shape[MESH_AXES.index(a)] for a in vocab_axes if a is not None)
    _require(not m.vocab_size or m.vocab_size % vocab_ways == 0,
             f'model.vocab_size ({m.vocab_size}) must be divisible by the mesh axes the '
             f'vocab rule shards over ({vocab_ways} devices)')
    _require(m.n_kv_heads % shape[2] == 0 and m.n_heads % shape[2] == 0,
             f'model.n_heads ({m.n_heads}) and n_kv_heads ({m.n_kv_heads}) must be divisible '
             f'by the tensor axis ({shape[2]})')
    if 'moe' in (m.mlp, m.mtp.block_mlp):
      axes = dict((r[0], r[1]) for r in config.mesh.rules).get('expert')
      axes = axes if isinstance(axes, (tuple, list)) else (axes,)
      ways = math.prod(shape[MESH_AXES.index(a)] for a in axes if a is not None)
      _require(m.moe.n_routed_experts % ways == 0,
               f'model.moe.n_routed_experts ({m.moe.n_routed_experts}) must be divisible by '
               f'the mesh axes the expert rule shards over ({ways} devices)')


def _validate_mtp_schedules(config) -> None:
  """model.mtp.lambda_* , curriculum and target_offsets (one-line errors)."""
  mtp = config.model.mtp
  kind = optional(config, 'model.mtp.lambda_schedule', 'step')
  _require(kind in ('step', 'linear', 'cosine'),
           f"model.mtp.lambda_schedule must be 'step', 'linear' or 'cosine', got {kind!r}")
  lv, lb = tuple(mtp.lambda_values), tuple(mtp.lambda_boundaries)
  if kind == 'step':
    _require(len(lv) == len(lb) + 1,
             f'model.mtp.lambda_values needs one more entry than model.mtp.lambda_boundaries '
             f'(got {len(lv)} values, {len(lb)} boundaries)')
    _require(all(b > 0 for b in lb), f'model.mtp.lambda_boundaries must be positive and '
             f'increasing, got {lb}')
  else:
    _require(len(lv) == len(lb) >= 1,
             f"model.mtp.lambda_schedule {kind!r} needs as many model.mtp.lambda_values as "
             f'model.mtp.lambda_boundaries (the value at each step), got {len(lv)} values, '
             f'{len(lb)} boundaries')
    _require(all(b >= 0 for b in lb), f'model.mtp.lambda_boundaries must be >= 0 and '
             f'increasing, got {lb}')
  _require(all(b2 > b1 for b1, b2 in zip(lb, lb[1:])),
           f'model.mtp.lambda_boundaries must be increasing, got {lb}')
  _require(all(isinstance(b, int) and not isinstance(b, bool) for b in lb),
           f'model.mtp.lambda_boundaries must be integer steps, got {lb}')
  _require(all(v >= 0 for v in lv), f'model.mtp.lambda_values must be >= 0, got {lv}')
  cur = optional(config, 'model.mtp.curriculum', 'none')
  _require(cur in ('none', 'forward', 'reverse'),
           f"model.mtp.curriculum must be 'none', 'forward' or 'reverse', got {cur!r}")
  phase = optional(config, 'model.mtp.curriculum_phase_steps', 0)
  _require(isinstance(phase, int) and not isinstance(phase, bool) and phase >= 0,
           f'model.mtp.curriculum_phase_steps must be a non-negative integer (0: '
           f'train.steps / (M + 1)), got {phase!r}')
  _require(cur == 'none' or mtp.depth > 0,
           f'model.mtp.curriculum={cur!r} switches MTP depths on and off, but '
           'model.mtp.depth is 0')
  offsets = tuple(optional(config, 'model.mtp.target_offsets', ()))
  if offsets:
    _require(len(offsets) == mtp.depth,
             f'model.mtp.target_offsets has {len(offsets)} entries but model.mtp.depth is '
             f'{mtp.depth}')
    _require(all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
             and offsets[0] >= 2 and all(b > a for a, b in zip(offsets, offsets[1:])),
             'model.mtp.target_offsets must be increasing integers >= 2 (depth k predicts '
             f't_(i+o_k); the main head has offset 1), got {offsets}')
    _require(offsets[-1] < config.data.seq_len,
             f'model.mtp.target_offsets ({offsets}) must stay below data.seq_len '
             f'({config.data.seq_len})')


def target_offsets(config) -> tuple:
  """(1, o_1, ..., o_M): the target offset of every head of `config`, the main one first."""
  mtp_depth = config.model.mtp.depth
  offsets = tuple(optional(config, 'model.mtp.target_offsets', ()))
  return (1,) + (offsets or tuple(range(2, mtp_depth + 2)))


def _validate_rope_scaling(rs) -> None:
  _require(rs.kind in ('', 'linear', 'llama3'),
           f"model.rope_scaling.kind must be '', 'linear' or 'llama3', got {rs.kind!r}")
  if rs.kind:
    _require(rs.factor > 0, f'model.rope_scaling.factor must be > 0, got {rs.factor}')
  if rs.kind == 'llama3':
    _require(0 < rs.low_freq_factor < rs.high_freq_factor,
             'model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got '
             f'{rs.low_freq_factor}, {rs.high_freq_factor}')
    require_positive_int('model.rope_scaling.original_max_positions', rs.original_max_positions)


def rope_scaling_tuple(config) -> tuple:
  """config.model.rope_scaling in layers.rope_inv_freq's form (() when off or absent)."""
  rs = optional(config, 'model.rope_scaling', None)
  if rs is None or not rs.kind:
    return ()
  if rs.kind == 'linear':
    return ('linear', float(rs.factor))
  return ('llama3', float(rs.factor), float(rs.low_freq_factor), float(rs.high_freq_factor),
          int(rs.original_max_positions))


def profile_window(config) -> tuple[int, int] | None:
  """train.profile_steps 'A:B' as (A, B): the trace covers steps A..B-1 (1-based, as logged).

  None when off. ConfigError when malformed, or when an evaluation or a checkpoint falls
  inside the window (their time would be traced as if it were training).
  """
  t = config.train
  text = t.profile_steps
  if text in ('', None):
    return None
  parts = str(text).split(':')
  try:
    a, b = (int(p) for p in parts) if len(parts) == 2 else (None, None)
  except ValueError:
    a = b = None
  if a is None or not 1 <= a < b:
    raise ConfigError(f"train.profile_steps must be 'A:B' with 1 <= A < B (trace steps A to "
                      f'B-1), got {text!r}')
  if a > t.steps:
    raise ConfigError(f'train.profile_steps {text!r} starts after the last step '
                      f'(train.steps={t.steps})')
  for name in ('eval_every', 'checkpoint_every'):
    every = t[name]
    if every and isinstance(every, int) and every > 0:
      inside = [s for s in range(a, min(b, t.steps + 1) - 1) if s % every == 0]
      if inside:
        what = 'an evaluation' if name == 'eval_every' else 'a checkpoint save'
        raise ConfigError(f'train.profile_steps {text!r}: step {inside[0]} inside the window '
                          f'is followed by {what} (train.{name}={every}); pick a window '
                          'between them so only training is traced')
  return a, b


DATA_SOURCES = ('tfds', 'files', 'jsonl', 'parquet', 'hf_disk')  # mtp_jax/data/user_data.py


def validate_data_source(d) -> None:
  """data.source / path / extensions / tokens_key values (the data layer reads the disk)."""
  _require(d.source in DATA_SOURCES, f'data.source must be one of {DATA_SOURCES}, got {d.source!r}')
  _require(isinstance(d.path, str), f'data.path must be a path string, got {d.path!r}')
  _require(d.source == 'tfds' or bool(d.path), f'data.source {d.source!r} reads data.path, which is empty')
  _require(d.source != 'tfds' or not d.path,
           f'data.path ({d.path!r}) is read only when data.source is one of {DATA_SOURCES[1:]}; '
           'set data.source, or data.dataset for a TFDS dataset')
  ext = d.extensions
  _require(isinstance(ext, (tuple, list)) and bool(ext)
           and all(isinstance(e, str) and len(e) > 1 and e.startswith('.') and '/' not in e
                   for e in ext),
           "data.extensions must be a non-empty tuple of file-name endings such as "
           f"('.md', '.txt'), got {ext!r}")
  _require(isinstance(d.tokens_key, str),
           f'data.tokens_key must be a field name or empty, got {d.tokens_key!r}')
  _require(d.source != 'files' or not d.tokens_key,
           f'data.tokens_key ({d.tokens_key!r}) names a field of records, but data.source files '
           'reads plain text files: leave it empty')


def _validate_block_kinds(config) -> None:
  """model.attention / mlp / mla.* / moe.* and model.mtp.block_* (one-line errors)."""
  m, mtp = config.model, config.model.mtp
  _require(m.attention in ATTENTION_KINDS,
           f'model.attention must be {_either(ATTENTION_KINDS)}, got {m.attention!r}')
  _require(m.mlp in MLP_KINDS, f'model.mlp must be {_either(MLP_KINDS)}, got {m.mlp!r}')
  _require(mtp.block_attention in ('',) + ATTENTION_KINDS,
           f"model.mtp.block_attention must be {_either(('',) + ATTENTION_KINDS)}, "
           f'got {mtp.block_attention!r}')
  _require(mtp.block_mlp in ('',) + MLP_KINDS,
           f"model.mtp.block_mlp must be {_either(('',) + MLP_KINDS)}, got {mtp.block_mlp!r}")
  uses_mla = 'mla' in (m.attention, mtp.block_attention)
  uses_moe = 'moe' in (m.mlp, mtp.block_mlp)
  if uses_mla:
    for name in ('kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'):
      require_positive_int(f'model.mla.{name}', m.mla[name])
    q = m.mla.q_lora_rank
    _require(isinstance(q, int) and not isinstance(q, bool) and q >= 0,
             f'model.mla.q_lora_rank must be a non-negative integer (0: no query compression), got {q!r}')
    _require(m.mla.qk_rope_head_dim % 2 == 0,
             f'model.mla.qk_rope_head_dim must be even for RoPE, got {m.mla.qk_rope_head_dim}')
  if uses_moe:
    mo = m.moe
    for name in ('n_routed_experts', 'num_experts_per_tok', 'moe_intermediate_size'):
      require_positive_int(f'model.moe.{name}', mo[name])
    for name in ('n_shared_experts', 'first_k_dense'):
      _require(isinstance(mo[name], int) and not isinstance(mo[name], bool) and mo[name] >= 0,
               f'model.moe.{name} must be a non-negative integer, got {mo[name]!r}')
    _require(mo.num_experts_per_tok <= mo.n_routed_experts,
             f'model.moe.num_experts_per_tok ({mo.num_experts_per_tok}) must be <= '
             f'model.moe.n_routed_experts ({mo.n_routed_experts})')
    _require(mo.first_k_dense <= m.n_layers,
             f'model.moe.first_k_dense ({mo.first_k_dense}) must be <= model.n_layers ({m.n_layers})')
    g, tg = mo.get('n_group', 1), mo.get('topk_group', 1)
    _require(mo.get('dispatch', 'auto') in MOE_DISPATCHES,
             f"model.moe.dispatch must be {_either(MOE_DISPATCHES)}, got {mo.get('dispatch')!r}")
    _require(mo.get('exchange', 'all_to_all') in MOE_EXCHANGES,
             f"model.moe.exchange must be {_either(MOE_EXCHANGES)}, got {mo.get('exchange')!r}")
    cf = mo.get('capacity_factor', 0.0)
    _require(isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf >= 0,
             f'model.moe.capacity_factor must be a number >= 0 (0: dropless), got {cf!r}')
    require_positive_int('model.moe.n_group', g)
    require_positive_int('model.moe.topk_group', tg)
    _require(mo.n_routed_experts % g == 0,
             f'model.moe.n_routed_experts ({mo.n_routed_experts}) must be divisible by '
             f'model.moe.n_group ({g})')
    _require(tg <= g, f'model.moe.topk_group ({tg}) must be <= model.moe.n_group ({g})')
    _require(g == 1 or tg * (mo.n_routed_experts // g) >= mo.num_experts_per_tok,
             f'model.moe.topk_group ({tg}) groups of {mo.n_routed_experts // g} experts cannot '
             f'hold model.moe.num_experts_per_tok ({mo.num_experts_per_tok})')
    _require(mo.routed_scaling_factor > 0,
             f'model.moe.routed_scaling_factor must be > 0, got {mo.routed_scaling_factor}')
    _require(mo.bias_update_rate >= 0 and mo.balance_loss_weight >= 0,
             'model.moe.bias_update_rate and model.moe.balance_loss_weight must be >= 0, '
             f'got {mo.bias_update_rate}, {mo.balance_loss_weight}')
    _require(not mtp.freeze_trunk or m.mlp != 'moe',
             'model.mtp.freeze_trunk with trunk MoE layers is not supported (their routing '
             'bias would still be updated)')


def optional(config, dotted: str, default):
  """config's `dotted` field, or `default` in a config saved before the field existed
  (decoding and --init_from read the configs of older runs)."""
  node = config
  for part in dotted.split('.'):
    if part not in node:
      return default
    node = node[part]
  return node
