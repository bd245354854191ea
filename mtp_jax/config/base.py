"""The base configuration: every field, with a comment, and its default.

Config files in `configs/` start from `base_config()` and override fields; every field is
documented here once, one small function per section (`base_config` composes them).
"""
from __future__ import annotations

import ml_collections

from mtp_jax.config.mesh import DEFAULT_AXES, DEFAULT_RULES

# model.remat: what each block keeps for the backward pass (mtp.remat_policy), least
# recomputation first after none
REMAT_POLICIES = ('none', 'block_inputs', 'block_mlp', 'block_norms', 'block', 'full')


def base_config() -> ml_collections.ConfigDict:
  """Every field, with a comment, and defaults for a small CPU model."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds parameter init and dropout-free training RNG
  m = c.model = model_fields()
  attention_fields(m)
  m.mla = mla_fields()
  m.moe = moe_fields()
  m.mtp = mtp_fields()
  c.loss = loss_fields()
  c.data = data_fields()
  c.train = train_fields()
  c.mesh = mesh_fields()
  return c


def model_fields() -> ml_collections.ConfigDict:
  """config.model's widths, norms, RoPE, dtype and memory switches (base_config adds the
  kinds and their sub-sections)."""
  m = ml_collections.ConfigDict()

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
  # positions the model supports (a loaded trunk's); data.seq_len must fit (0: no limit)
  m.max_positions = 0
  m.rope_scaling = rope_scaling_fields()
  m.tie_embeddings = True  # OutHead = Emb^T (False: a separate output kernel)
  # compute dtype (params and optimizer state stay float32): float32 | bfloat16 | float16 |
  # auto: per job (runtime/peak.py compute_dtype): training bfloat16 on a CPU whose bf16 dot
  # runs >= 2x its f32 dot (e.g. with AMX), else float32; decoding and Hugging Face imports
  # float32 (their outputs are promised equal to plain decoding's / transformers')
  m.dtype = 'auto'
  # what model.dtype asked for before a run resolved it (set by the run, saved with it: a
  # decode of a run trained under 'auto' resolves 'auto' again, for decoding); '' unset
  m.dtype_requested = ''
  m.init_std = 0.02  # stddev of the embedding init
  # rematerialisation per block (REMAT_POLICIES; docs/scaling.md has what each costs): none |
  # block (keep weight-matmul outputs) | block_norms, block_mlp, block_inputs (block and more)
  # | full (keep block inputs)
  m.remat = 'none'
  # lax.scan over stacked trunk layers and MTP depths (compile time, memory; same params)
  m.scan_layers = False
  # microbatches per (accumulation) batch through the pipeline of mesh.axes.stage > 1 stages
  # (model/pipeline.py; bubble (S - 1) / (N + S - 1)); 0: as many as stages
  m.pipeline_microbatches = 0
  # sequence chunk for the vocab projection + CE (0: whole length, all depths in one product)
  m.loss_chunk = 0
  return m


def rope_scaling_fields() -> ml_collections.ConfigDict:
  """config.model.rope_scaling: RoPE frequency scaling, as Hugging Face's rope_scaling /
  rope_parameters (layers.rope_inv_freq)."""
  rs = ml_collections.ConfigDict()
  rs.kind = ''  # '' none | linear (positions / factor) | llama3 (Llama 3.1's banded rule)
  rs.factor = 1.0  # linear, llama3: the stretch factor
  rs.low_freq_factor = 1.0  # llama3: wavelengths > original / this are stretched
  rs.high_freq_factor = 4.0  # llama3: wavelengths < original / this are kept
  rs.original_max_positions = 8192  # llama3: the context length before scaling
  return rs


def attention_fields(m: ml_collections.ConfigDict) -> None:
  """config.model's block kinds (config/kinds.py) and the attention core's settings."""
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


def mla_fields() -> ml_collections.ConfigDict:
  """config.model.mla: multi-head latent attention (DeepSeek-V2/V3; mtp_jax/model/mla.py),
  used when attention='mla'. n_heads heads; head_dim and n_kv_heads are unused by MLA
  blocks."""
  mla = ml_collections.ConfigDict()
  mla.q_lora_rank = 0  # query latent width (0: no query compression, one q_proj)
  mla.kv_lora_rank = 64  # key/value latent width c_kv (what an MLA cache would hold)
  mla.qk_nope_head_dim = 32  # per-head query/key width without RoPE
  mla.qk_rope_head_dim = 16  # per-head rotary query width; one rotary key shared by all heads
  mla.v_head_dim = 32  # per-head value width
  return mla


def moe_fields() -> ml_collections.ConfigDict:
  """config.model.moe: DeepSeekMoE (mtp_jax/model/moe.py), used when mlp='moe': shared +
  sigmoid-routed experts."""
  moe = ml_collections.ConfigDict()
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
  return moe


def mtp_fields() -> ml_collections.ConfigDict:
  """config.model.mtp: the MTP depths, their head kind, loss weights and training switches."""
  mtp = ml_collections.ConfigDict()
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
  # Leap depths that read no token their leap skips: depth k reads t_(i+a_k), a_k the
  # longest run 1..a of offsets that a head before depth k predicts (at most o_k - 1),
  # instead of t_(i+o_k-1), the token just before its target, which a leap skips. Causal
  # attention also shows position i the tokens its neighbours read (t_(i+a-1), ...), so a
  # run from 1 is the only input that leaks no skipped token. Adjacent depths are unchanged.
  mtp.strict_leaps = False
  # One MTP module whose weights serve every depth (FastMTP's recursive drafter): depth k
  # runs the same module on h^{k-1} and t_(i+k); the compute is per depth, the parameters
  # are one module's (model.scan_layers leaves its depths unrolled). Sequential kind, depth
  # >= 2 and a dense MTP block only (an MoE block's routing statistics are per call).
  mtp.share_modules = False
  # stop_gradient on h^0 only where it enters depth 1 (Emb, OutHead still shared)
  mtp.detach_trunk = False
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
  return mtp


def loss_fields() -> ml_collections.ConfigDict:
  """config.loss."""
  lo = ml_collections.ConfigDict()
  # What MTP depth k at position i is trained to predict: 'data' = the true t_(i+k+1);
  # 'self' = the main model's greedy argmax at position i+k (the token the verifier picks
  # given the true prefix; self-distillation, no gradient through it), on the same valid
  # positions; 'soft' = the main model's whole distribution at i+k (cross-entropy against
  # its softmax, no gradient through it): what speculative *sampling* accepts against, so
  # the drafts for T > 0. train/loss_mtp_k is then the loss against those targets
  # (for 'soft' the KL plus the teacher's entropy); acc_mtp_k and every eval/ figure stay
  # measured against the data.
  lo.mtp_targets = 'data'
  return lo


def data_fields() -> ml_collections.ConfigDict:
  """config.data: where documents come from, the tokenizer and the batch."""
  d = ml_collections.ConfigDict()
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
  # byte | sentencepiece | hf (a Hugging Face tokenizer.json; --init_from hf:DIR sets it)
  d.tokenizer = 'byte'
  d.spm_model = ''  # path of a SentencePiece .model (scripts/train_tokenizer.py)
  d.hf_tokenizer = ''  # tokenizer=hf: a local directory holding tokenizer.json (and its configs)
  d.seq_len = 256  # tokens per packed sequence T
  d.batch_size = 16  # global batch (sequences per optimizer step)
  d.shuffle_seed = 0  # seed of the document shuffle
  d.worker_count = 0  # grain worker processes (0: in the main process)
  d.read_threads = 0  # threads reading + tokenizing documents (0: from the host's CPU count)
  d.prefetch_buffer = 0  # documents read ahead (0: 32 per read thread)
  return d


def train_fields() -> ml_collections.ConfigDict:
  """config.train: the optimizer, the loop's cadence, checkpoints and staying alive."""
  t = ml_collections.ConfigDict()
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
  # validation prompts decoded (greedy) per eval -> eval/decode_* (0 or mtp.depth 0: off)
  t.eval_decode_prompts = 0
  t.eval_decode_tokens = 32  # tokens generated per such prompt (data.seq_len // 2 prompt tokens)
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
  return t


def mesh_fields() -> ml_collections.ConfigDict:
  """config.mesh: the device mesh and the logical-axis rules (config/mesh.py)."""
  mesh = ml_collections.ConfigDict()
  # the size of each named mesh axis (config/mesh.py MESH_AXES, outermost first); one -1
  # takes the remaining devices. stage > 1 pipelines the trunk (model.pipeline_microbatches);
  # context shards every sequence (context parallelism, docs/training.md).
  mesh.axes = ml_collections.ConfigDict(dict(DEFAULT_AXES))
  # the older positional form (data, fsdp, tensor), still read when set (configs and saved
  # config.json files of older runs); None: mesh.axes alone
  mesh.shape = ml_collections.config_dict.placeholder(tuple)
  mesh.rules = DEFAULT_RULES  # logical axis -> mesh axis table
  return mesh
