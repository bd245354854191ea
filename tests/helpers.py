"""Plain helpers shared by the tests: configs, the word language, batches, a trained model.

No fixtures and no environment set-up here (conftest.py does that, before JAX starts),
so tests/multihost_worker.py can import it too.
"""
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_files, config_lib
from mtp_jax.model import moe as moe_lib
from mtp_jax.runtime import sharding
from mtp_jax.train import loss as loss_lib
from mtp_jax.train import steps as steps_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_DECODE = (4, 16)  # tiny_run's decode eval: prompts, new tokens each
MULTIHOST_STEPS = 4  # steps of test_multihost's two-process job


# -- configs -----------------------------------------------------------------------------------
def load_config(name: str):
  """configs/<name>.py's get_config()."""
  return config_files.load(os.path.join(REPO, 'configs', f'{name}.py'))


def tiny_model_config(depth=2, kind='sequential', vocab=64, **model):
  """A config whose model is tiny; data fields untouched."""
  c = config_lib.base_config()
  c.model.vocab_size = vocab
  c.model.d_model = 32
  c.model.n_layers = 2
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 8
  c.model.mlp_dim = 64
  c.model.mtp.depth = depth
  c.model.mtp.kind = kind
  c.data.seq_len = 16
  c.data.batch_size = 8
  for k, v in model.items():
    c.model[k] = v
  return c


# -- the word language: tiny byte-level models that learn it reach high acceptance ----------
MAX_NEW = 24  # every greedy test uses this bucket, so programs are shared
WORDS = ['abc', 'defg', 'hij', 'klmno', 'pqr', 'stuv', 'wxyz', '0123']  # disjoint letters


def byte_config(depth=3, kind='sequential'):
  """A tiny model over the byte tokenizer's vocabulary (258 -> 320), so the CLI can run it."""
  return tiny_model_config(depth, kind, vocab=0)


def byte_ids(text):
  return [b + 2 for b in text.encode()]


def word_text(rng, n_chars):
  """Random words separated by spaces: deterministic inside a word, random at its start."""
  out = ''
  while len(out) < n_chars:
    out += WORDS[rng.integers(len(WORDS))] + ' '
  return out


def train_word_model(devices, tmp_path_factory, config=None):
  """A model trained briefly on the word language (high acceptance), and its workdir.

  config: a byte-vocabulary model config (default: byte_config(3), M = 3).
  The workdir holds a checkpoint written exactly as train_and_evaluate writes one
  (model + optimizer state, meta with the config) and config.json.
  """
  config = byte_config(3) if config is None else config
  config.data.seq_len, config.data.batch_size = 64, 16
  config.train.steps, config.train.warmup_steps, config.train.lr = 100, 10, 1e-2
  config.model.mtp.weights = (1.0,) * config.model.mtp.depth
  config.mesh.shape = (1, 1, 1)
  ts, state = steps_lib.setup(config, devices[:1])
  rng = np.random.default_rng(0)
  pos = np.broadcast_to(np.arange(64, dtype=np.int32), (16, 64))
  for _ in range(config.train.steps):
    tokens = np.array([byte_ids(word_text(rng, 80)[(s := rng.integers(8)):s + 64])
                       for _ in range(16)], np.int32)
    batch = {'tokens': tokens, 'segment_ids': np.ones_like(tokens), 'positions': pos}
    state, metrics = steps_lib.run_step(ts, state, batch)
  # Entropy floor: log(8) at each word start (1 position in 4.6), 0 elsewhere: 0.45 per depth.
  per_depth = metrics['loss_sum'] / metrics['count']
  assert np.all(per_depth < 0.6), per_depth
  workdir = str(tmp_path_factory.mktemp('decode_workdir'))
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), async_save=False)
  meta = {'step': config.train.steps, 'config': json.loads(config.to_json_best_effort())}
  ckpt.save(config.train.steps, state, meta=meta, force=True)
  ckpt.close()
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  model, _ = nnx.merge(ts.graphdef, state)
  return model, workdir


def word_prompts(n, seed):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    text = word_text(rng, 40)
    start = int(rng.integers(0, 8))
    out.append(byte_ids(text[start:start + 1 + i % 16]))
  return out


# -- batches and models --------------------------------------------------------------------------
def synthetic_batches(n, batch, seq_len, vocab=258, seed=0):
  """Packed batches with document boundaries and padding, as numpy (host) arrays."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    seg = np.zeros((batch, seq_len), np.int32)
    pos = np.zeros((batch, seq_len), np.int32)
    for r in range(batch):
      i, s = 0, 1
      end = seq_len - rng.integers(0, 5)  # some rows end in padding
      while i < end:
        n_doc = min(int(rng.integers(2, seq_len)), end - i)
        seg[r, i:i + n_doc] = s
        pos[r, i:i + n_doc] = np.arange(n_doc)
        i, s = i + n_doc, s + 1
    tokens = np.where(seg > 0, rng.integers(2, vocab, size=seg.shape), 0).astype(np.int32)
    out.append({'tokens': tokens, 'segment_ids': seg, 'positions': pos})
  return out


SEG = np.array([[1] * 5 + [2] * 6 + [3] * 3 + [0] * 2, [1] * 16])
POS = np.array([list(range(5)) + list(range(6)) + list(range(3)) + [0, 0], list(range(16))])
# A document of n tokens has max(n - k - 1, 0) valid positions at depth k:
# depth 0: (4 + 5 + 2) + 15, depth 1: (3 + 4 + 1) + 14, depth 2: (2 + 3 + 0) + 13.


def loss_batch(seed=0):
  """Random tokens over SEG's three documents and padding."""
  tokens = np.random.default_rng(seed).integers(1, 64, size=SEG.shape)
  tokens = np.where(SEG == 0, 0, tokens)
  return {'tokens': jnp.asarray(tokens, jnp.int32), 'segment_ids': jnp.asarray(SEG, jnp.int32),
          'positions': jnp.asarray(POS, jnp.int32)}


def loss_grads(model, b, weights, chunk=0):
  """((loss, sums), grads w.r.t. every Param) of the multi-depth loss on batch b."""
  graph, params, rest = nnx.split(model, nnx.Param, ...)

  def f(p):
    return loss_lib.loss_and_metrics(nnx.merge(graph, p, rest), b, weights, chunk=chunk)

  return jax.jit(jax.value_and_grad(f, has_aux=True))(params)


def randomize(model, seed=1):
  """Replaces every parameter (norm scales too) with seeded random values."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: (rng.normal(size=x.shape) * (0.3 if x.ndim > 1 else 0.5)
                                   + (1.0 if x.ndim == 1 else 0.0)).astype(np.float32), params)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return jax.tree.map(np.float64, params)


def quiet_tiny(data_dir, fields: dict, **train_fields):
  """configs/tiny.py on the prepared data at `data_dir` (None: its own), without a progress
  bar, its train fields set from `fields` and then `train_fields`."""
  c = load_config('tiny')
  if data_dir is not None:
    c.data.data_dir = data_dir
  c.train.progress = False
  for k, v in {**fields, **train_fields}.items():
    c.train[k] = v
  return c


def local_url_scheme(scheme: str) -> type:
  """Registers `scheme`:// with etils.epath as a path class that resolves 'scheme://b/run'
  to `root`/b/run (set the class's `root`, e.g. with monkeypatch), as epath resolves gs://
  through its GCS backend: the trainer, orbax and the readers take the URL path while
  nothing leaves this machine. Returns the class."""
  prefix = f'{scheme}://'

  class LocalSchemePath(type(epath.Path('/'))):
    root = '/nonexistent'

    def __new__(cls, *args):
      args = [a.replace(prefix, cls.root + '/', 1) if isinstance(a, str) else a for a in args]
      return super().__new__(cls, *args)

  epath.register_path_cls(prefix)(LocalSchemePath)
  return LocalSchemePath


def job_config(data_dir):
  c = load_config('tiny')
  c.data.data_dir = data_dir
  c.train.steps = MULTIHOST_STEPS
  c.train.log_every = 1
  c.train.eval_every = 0
  c.train.checkpoint_every = 0
  c.train.eval_batches = 1
  return c


def dsv3_model_config(depth=1, attention='mla', mlp='moe', q_lora_rank=12, **moe):
  """tiny_model_config with MLA and / or DeepSeekMoE blocks (layer 0 dense, MoE after)."""
  c = tiny_model_config(depth)
  c.model.attention, c.model.mlp = attention, mlp
  c.model.mla.q_lora_rank = q_lora_rank
  c.model.mla.kv_lora_rank = 8
  c.model.mla.qk_nope_head_dim = 6
  c.model.mla.qk_rope_head_dim = 4
  c.model.mla.v_head_dim = 5  # differs from qk_nope + qk_rope: exercises the padded core
  c.model.moe.n_routed_experts = 4
  c.model.moe.num_experts_per_tok = 2
  c.model.moe.moe_intermediate_size = 16
  c.model.moe.routed_scaling_factor = 2.5
  c.model.moe.first_k_dense = 1
  for k, v in moe.items():
    c.model.moe[k] = v
  return c


def params_with_routing_bias(model, seed=5, scale=0.3):
  """randomize(model), then random routing biases too; the numpy tree of both."""
  randomize(model)
  rng = np.random.default_rng(seed)
  biases = jax.tree.map(lambda x: (rng.normal(size=x.shape) * scale).astype(np.float32),
                        nnx.to_pure_dict(nnx.state(model, moe_lib.RoutingBias)))
  bias_state = nnx.state(model, moe_lib.RoutingBias)
  nnx.replace_by_pure_dict(bias_state, biases)
  nnx.update(model, bias_state)
  merged = nnx.to_pure_dict(nnx.state(model, nnx.Any(nnx.Param, moe_lib.RoutingBias)))
  return jax.tree.map(np.float64, merged)


def set_field(config, dotted: str, value):
  """config.<dotted> = value for a dotted path below config.model (e.g. 'mla.kv_lora_rank')."""
  node = config.model
  *path, last = dotted.split('.')
  for part in path:
    node = node[part]
  node[last] = value


def step_losses(config, devices, batches):
  """Train steps from a fresh sharded state over `batches`: (losses, the final state)."""
  ts, state = steps_lib.setup(config, devices)
  losses = []
  for batch in batches:
    state, m = steps_lib.run_step(ts, state, batch)
    losses.append(float(m['loss']))
  return losses, state


# -- tiny Hugging Face models (tests of mtp_jax/interop/hf.py) ----------------------------
HF_TOKENIZER_MERGES = 300  # byte-level BPE vocabulary before the special tokens
HF_FAMILIES = {
    # Llama 3 style: untied head, llama3 RoPE scaling (all three bands at head_dim 16), a
    # bos added by the tokenizer, a model vocabulary padded past the tokenizer's, shards.
    'llama': dict(cls='LlamaForCausalLM', specials=['<|begin_of_text|>', '<|end_of_text|>'],
                  bos='<|begin_of_text|>', eos='<|end_of_text|>', pad=None, vocab_pad=18,
                  config=dict(tie_word_embeddings=False, rope_theta=10000.0,
                              rope_scaling={'rope_type': 'llama3', 'factor': 8.0,
                                            'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                            'original_max_position_embeddings': 64})),
    # Qwen2 style: q/k/v biases, tied embeddings, pad = eos = <|endoftext|>, linear RoPE,
    # a vocabulary padded to an even size (as Qwen's 151936 > 151665), so a tensor axis of
    # 2 splits it.
    'qwen2': dict(cls='Qwen2ForCausalLM', specials=['<|endoftext|>', '<|im_start|>', '<|im_end|>'],
                  bos=None, eos='<|endoftext|>', pad='<|endoftext|>', vocab_pad=1,
                  config=dict(tie_word_embeddings=True, rope_theta=1000.0,
                              rope_scaling={'rope_type': 'linear', 'factor': 2.0})),
}


def hf_tokenizer_texts():
  """A few standard-library sources plus Unicode: what the tiny BPE is trained on."""
  import json as json_mod
  import textwrap
  texts = [pathlib.Path(m.__file__).read_text(encoding='utf-8') for m in (json_mod, textwrap)]
  return texts + ['unicode: é → 日本語 🐍 naïve café\n'] * 4


def make_hf_model(directory, family, seed=0):
  """save_pretrained a tiny random float32 `family` model (HF_FAMILIES) and its tokenizer.

  2 layers, d 64, 4 heads / 2 KV heads, vocab ~300; every weight random, biases and norm
  scales included (HF initialises those to 0 / 1, which would hide a mapping error).
  """
  # Deferred: torch / transformers are test extras, needed only by the HF tests.
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  spec = HF_FAMILIES[family]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(hf_tokenizer_texts(), trainers.BpeTrainer(
      vocab_size=HF_TOKENIZER_MERGES, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  tok.add_special_tokens(spec['specials'])  # ids at the end: eos / pad are not 0 or 1
  if spec['bos']:
    tok.post_processor = processors.TemplateProcessing(
        single=f"{spec['bos']} $A", special_tokens=[(spec['bos'], tok.token_to_id(spec['bos']))])
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token=spec['bos'], eos_token=spec['eos'], pad_token=spec['pad'])
  fast.save_pretrained(directory)
  vocab = tok.get_vocab_size() + spec['vocab_pad']
  ids = {k: (tok.token_to_id(spec[k]) if spec[k] else None) for k in ('bos', 'eos', 'pad')}
  config = getattr(transformers, spec['cls'].replace('ForCausalLM', 'Config'))(
      vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      rms_norm_eps=1e-5, bos_token_id=ids['bos'], eos_token_id=ids['eos'],
      pad_token_id=ids['pad'], initializer_range=0.1, **spec['config'])
  torch.manual_seed(seed)
  model = getattr(transformers, spec['cls'])(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('bias') or name.endswith('norm.weight'):
        p.copy_((1.0 if name.endswith('norm.weight') else 0.0) + 0.2 * torch.randn_like(p))
  model.save_pretrained(directory, max_shard_size='100KB' if family == 'llama' else '50GB')
  return model


def write_workdir(path, config, seed=1, steps=(3,)):
  """A training workdir holding checkpoints `steps` of a random model of `config` (routing
  biases random too), as the trainer writes them; returns the model."""
  from mtp_jax import train_state
  from mtp_jax.data import tokenizers
  model, optimizer = train_state.create_model_and_optimizer(tokenizers.resolve_vocab_size(config))
  if config.model.mlp == 'moe':
    params_with_routing_bias(model, seed)
  else:
    randomize(model, seed)
  ckpt = ckpt_lib.Checkpointer(os.path.join(path, 'checkpoints'), async_save=False)
  state = nnx.state((model, optimizer))
  for step in steps:
    ckpt.save(step, state, meta={'step': step, 'config': json.loads(config.to_json_best_effort()),
                                 **ckpt_lib.integrity_meta(state)}, force=True)
  ckpt.close()
  return model


# -- a small jsonl corpus for trainer runs on one device -----------------------------------------
JSONL_WORDS = ['alpha', 'beta', 'gamma', 'delta', 'def', 'return', 'class', 'import', 'while']


def write_jsonl(path, lines=30, bad_line=None):
  """`lines` records of word text; line `bad_line` (1-based) an unterminated JSON string."""
  with open(path, 'w') as f:
    for i in range(1, lines + 1):
      if i == bad_line:
        f.write('{"text": "unterminated\n')
      else:
        text = ' '.join(JSONL_WORDS[(i * 7 + j * 3) % len(JSONL_WORDS)] for j in range(60))
        f.write(json.dumps({'text': text}) + '\n')
  return str(path)


def jsonl_config(path, **train_fields):
  """tiny.py reading the jsonl file(s) at `path`: seq_len 32, a few quiet steps."""
  fields = dict(steps=4, log_every=2, eval_every=0, checkpoint_every=0, eval_batches=1)
  c = quiet_tiny(None, fields, **train_fields)
  c.data.source, c.data.path, c.data.seq_len = 'jsonl', str(path), 32
  c.data.validation_percent = 20
  return c


def packed_segments(b: int, t: int, seed: int = 0, cuts_from: int = 1,
                    cuts_before: int | None = None, padding: int = 2) -> np.ndarray:
  """[b, t] int32 segment ids: each row three packed documents, cut at two random places in
  [cuts_from, cuts_before) (default t - 2), then `padding` positions of segment 0."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(cuts_from, cuts_before or t - 2), size=2, replace=False))
    seg[r, :cuts[0]], seg[r, cuts[0]:cuts[1]], seg[r, cuts[1]:t - padding] = 1, 2, 3
  return seg


def compiled_tiny_step(dtype: str, depth: int):
  """The compiled train step of the tiny model at `dtype` on one device, with its state and
  global batch."""
  c = tiny_model_config(depth=depth)
  c.model.dtype = dtype
  ts, state = steps_lib.setup(c, jax.devices()[:1])
  batch = next(iter(synthetic_batches(1, c.data.batch_size, c.data.seq_len, vocab=64)))
  with sharding.use_mesh(ts.mesh, ts.rules):
    gbatch = sharding.host_batch_to_global(batch, ts.mesh)
    compiled = ts.train_step.lower(state, gbatch).compile()
  return compiled, state, gbatch
