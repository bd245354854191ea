"""Hugging Face trunks: `--init_from hf:DIR` loads a local Llama / Mistral / Qwen2 model.

DIR is a directory in the standard layout (config.json, model.safetensors or shards with
model.safetensors.index.json, tokenizer.json or else a SentencePiece tokenizer.model);
nothing is ever downloaded. Three steps,
each with one-line errors naming the field or tensor, all before anything compiles:
  `apply_to_config`  config.json -> config.model (sizes, RoPE, norms, biases, vocab) and
                     data.tokenizer = 'hf' on DIR's tokenizer;
  `check_weights`    every expected tensor present with its shape, nothing unknown
                     (safetensors headers only, no weight is read);
  `load_into`        tensor by tensor straight into the sharded target: each device's
                     block is sliced out of the file (`safe_open(...).get_slice`), so a
                     host holds at most one tensor's local blocks at a time, never a
                     full copy of the model.
The MTP modules are not in a plain causal LM: they keep their fresh initialisation.

Tensor names (this module's table, `tensor_table`): Hugging Face's Llama layout, which
Mistral and Qwen2 share (model.embed_tokens, model.layers.{i}.input_layernorm,
self_attn.{q,k,v,o}_proj (+ q/k/v .bias in Qwen2), post_attention_layernorm,
mlp.{gate,up,down}_proj, model.norm, lm_head). torch Linear weights are [out, in],
this project's kernels [in, out] with heads split out.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open

from mtp_jax import config_lib
from mtp_jax.errors import ConfigError
from mtp_jax.data import tokenizers
from mtp_jax.model.mtp import MTPModel, ModelArgs

PREFIX = 'hf:'
# architectures entry -> family; all three are dense GQA + SwiGLU with Llama's names.
SUPPORTED = {'LlamaForCausalLM': 'llama', 'MistralForCausalLM': 'mistral',
             'Qwen2ForCausalLM': 'qwen2'}
# Why some well-known ones are refused (anything else is refused as unknown).
_NOT_YET = {
    'DeepseekV3ForCausalLM': 'MLA + MoE blocks are not wired to Hugging Face weights yet',
    'DeepseekV2ForCausalLM': 'MLA + MoE blocks are not wired to Hugging Face weights yet',
    'MixtralForCausalLM': 'MoE blocks are not wired to Hugging Face weights yet',
    'Qwen2MoeForCausalLM': 'MoE blocks are not wired to Hugging Face weights yet',
    'Qwen3ForCausalLM': 'Qwen3 has q/k norms, which this project\'s attention lacks',
    'GemmaForCausalLM': 'Gemma scales embeddings and offsets its norms',
}
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # old checkpoints store RoPE buffers


def source_dir(init_from: str | None) -> str | None:
  """DIR of an `hf:DIR` --init_from, else None (an orbax workdir / checkpoint)."""
  if not init_from or not init_from.startswith(PREFIX):
    return None
  rest = init_from[len(PREFIX):].strip()
  return os.path.abspath(os.path.expanduser(rest)) if rest else ''  # '': read_config says why


def _err(directory: str, text: str) -> ConfigError:
  return ConfigError(f'--init_from hf:{directory}: {text}')


def read_config(directory: str) -> dict:
  """config.json of a local model directory; ConfigError when it is not one."""
  if not directory:
    raise ConfigError('--init_from hf:DIR needs a local directory after hf: (nothing is '
                      'downloaded from the Hugging Face hub)')
  if not os.path.isdir(directory):
    what = 'does not exist' if not os.path.exists(directory) else 'is not a directory'
    raise _err(directory, f'{what}: give a local directory holding config.json and '
               '*.safetensors (nothing is downloaded from the Hugging Face hub)')
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise _err(directory, 'no config.json in the directory')
  try:
    with open(path, encoding='utf-8') as f:
      cfg = json.load(f)
  except (OSError, ValueError) as e:
    raise _err(directory, f'config.json cannot be read as JSON ({e})') from e
  if not isinstance(cfg, dict):
    raise _err(directory, 'config.json is not a JSON object')
  return cfg


def _architecture(directory: str, cfg: dict) -> str:
  arch = cfg.get('architectures')
  if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
    raise _err(directory, f'config.json architectures must list one model class, got {arch!r}')
  name = arch[0]
  if name in SUPPORTED:
    return SUPPORTED[name]
  why = _NOT_YET.get(name, 'unknown architecture')
  raise _err(directory, f'config.json architectures {name!r} is not supported ({why}); '
             f'supported: {", ".join(SUPPORTED)}')


def _int(directory, cfg, field, default=None) -> int:
  value = cfg.get(field, default)
  if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
    raise _err(directory, f'config.json {field} must be a positive integer, got {value!r}')
  return value


def _rope(directory: str, cfg: dict) -> tuple[float, dict]:
  """(rope_theta, model.rope_scaling fields) from transformers 5's rope_parameters or the
  older rope_theta + rope_scaling."""
  params = cfg.get('rope_parameters')
  field = 'rope_parameters'
  if params is None:
    params, field = dict(cfg.get('rope_scaling') or {}), 'rope_scaling'
    params.setdefault('rope_theta', cfg.get('rope_theta', 10000.0))
  if not isinstance(params, dict):
    raise _err(directory, f'config.json {field} must be an object, got {params!r}')
  if 'full_attention' in params and isinstance(params['full_attention'], dict):
    params = params['full_attention']  # per-layer-type parameters (transformers 5)
  theta = params.get('rope_theta', cfg.get('rope_theta', 10000.0))
  if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
    raise _err(directory, f'config.json {field}.rope_theta must be > 0, got {theta!r}')
  kind = params.get('rope_type', params.get('type', 'default')) or 'default'
  if cfg.get('partial_rotary_factor', params.get('partial_rotary_factor', 1.0)) != 1.0:
    raise _err(directory, 'config.json partial_rotary_factor != 1 is not supported')

  def num(name, default=None):
    v = params.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
      raise _err(directory, f'config.json {field}.{name} must be a positive number, got {v!r}')
    return v

  if kind == 'default':
    return float(theta), {'kind': ''}
  if kind == 'linear':
    return float(theta), {'kind': 'linear', 'factor': float(num('factor'))}
  if kind == 'llama3':
    original = num('original_max_position_embeddings')
    return float(theta), {'kind': 'llama3', 'factor': float(num('factor')),
                          'low_freq_factor': float(num('low_freq_factor', 1.0)),
                          'high_freq_factor': float(num('high_freq_factor', 4.0)),
                          'original_max_positions': int(original)}
  raise _err(directory, f'config.json {field}.rope_type {kind!r} is not supported '
             "(supported: default, linear, llama3)")


def model_fields(directory: str, cfg: dict) -> dict:
  """config.model fields (dotted names, rope_scaling as a dict) of a config.json."""
  family = _architecture(directory, cfg)
  if cfg.get('quantization_config'):
    raise _err(directory, 'config.json quantization_config: quantized weights are not '
               'supported (give float32 / bfloat16 / float16 safetensors)')
  act = cfg.get('hidden_act', cfg.get('hidden_activation', 'silu'))
  if act != 'silu':
    raise _err(directory, f"config.json hidden_act must be 'silu' (SwiGLU), got {act!r}")
  if cfg.get('mlp_bias'):
    raise _err(directory, 'config.json mlp_bias=true is not supported (bias-free SwiGLU only)')
  if family != 'qwen2' and cfg.get('attention_bias'):
    # Llama's attention_bias also puts a bias on o_proj, which this attention lacks.
    raise _err(directory, 'config.json attention_bias=true (q/k/v/o biases) is not supported '
               'for Llama / Mistral; Qwen2-style q/k/v biases are')
  d = _int(directory, cfg, 'hidden_size')
  heads = _int(directory, cfg, 'num_attention_heads')
  kv = _int(directory, cfg, 'num_key_value_heads', heads)
  if heads % kv:
    raise _err(directory, f'config.json num_attention_heads ({heads}) must be a multiple of '
               f'num_key_value_heads ({kv})')
  head_dim = cfg.get('head_dim') or (d // heads if d % heads == 0 else None)
  if head_dim is None:
    raise _err(directory, f'config.json hidden_size ({d}) is not divisible by '
               f'num_attention_heads ({heads}) and no head_dim is given')
  head_dim = _int(directory, {'head_dim': head_dim}, 'head_dim')
  if head_dim % 2:
    raise _err(directory, f'config.json head_dim must be even for RoPE, got {head_dim}')
  theta, scaling = _rope(directory, cfg)
  eps = cfg.get('rms_norm_eps', 1e-6)
  if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
    raise _err(directory, f'config.json rms_norm_eps must be > 0, got {eps!r}')
  max_pos = _int(directory, cfg, 'max_position_embeddings', 0) if cfg.get(
      'max_position_embeddings') is not None else 0
  # Sliding-window attention equals full attention on sequences no longer than the
  # window, so a model with one is loaded with max_positions capped at the window.
  layer_types = cfg.get('layer_types') or []
  sliding = (cfg.get('sliding_window') if (
      family == 'mistral' or cfg.get('use_sliding_window')
      or 'sliding_attention' in layer_types) else None)
  if sliding is not None:
    sliding = _int(directory, cfg, 'sliding_window')
    max_pos = min(max_pos, sliding) if max_pos else sliding
  tie = cfg.get('tie_word_embeddings', False)
  if not isinstance(tie, bool):
    raise _err(directory, f'config.json tie_word_embeddings must be true or false, got {tie!r}')
  return {
      'vocab_size': _int(directory, cfg, 'vocab_size'), 'd_model': d,
      'n_layers': _int(directory, cfg, 'num_hidden_layers'), 'n_heads': heads,
      'n_kv_heads': kv, 'head_dim': head_dim,
      'mlp_dim': _int(directory, cfg, 'intermediate_size'), 'rope_theta': theta,
      'norm_eps': float(eps), 'tie_embeddings': tie, 'attention_bias': family == 'qwen2',
      'max_positions': max_pos, 'attention': 'gqa', 'mlp': 'dense',
      'rope_scaling': scaling,
  }


def apply_to_config(config, directory: str) -> list[str]:
  """Sets config.model from DIR's config.json and data.tokenizer to DIR's tokenizer.

  Returns 'field: old -> new' for each value it changed (the trainer reports them).
  The MTP fields (model.mtp.*) and the training switches stay the config's.
  """
  fields = model_fields(directory, read_config(directory))
  changed = []

  def put(node, name, value, dotted):
    if node[name] != value:
      changed.append(f'{dotted}: {node[name]!r} -> {value!r}')
      node[name] = value

  m = config.model
  scaling = fields.pop('rope_scaling')
  for name, value in fields.items():
    put(m, name, value, f'model.{name}')
  rs_default = config_lib.base_config().model.rope_scaling
  for name in rs_default.keys():
    put(m.rope_scaling, name, scaling.get(name, rs_default[name]), f'model.rope_scaling.{name}')
  spm_path = os.path.join(os.path.abspath(os.path.expanduser(directory)), 'tokenizer.model')
  if (not os.path.isfile(os.path.join(directory, 'tokenizer.json'))
      and os.path.isfile(spm_path)):
    # A slow-tokenizer-only release (Llama 2 style): its SentencePiece model, ids as
    # released; no bos is added (documents are separated by eos), pad falls back to eos.
    put(config.data, 'tokenizer', 'sentencepiece', 'data.tokenizer')
    put(config.data, 'spm_model', spm_path, 'data.spm_model')
    tok, name = tokenizers.SentencePieceTokenizer.from_file(spm_path), 'tokenizer.model'
  else:
    put(config.data, 'tokenizer', 'hf', 'data.tokenizer')
    put(config.data, 'hf_tokenizer', directory, 'data.hf_tokenizer')
    tok, name = tokenizers.HFTokenizer.from_dir(directory), 'tokenizer.json'  # errors now
  if tok.vocab_size > m.vocab_size:
    raise _err(directory, f'{name} has {tok.vocab_size} tokens but config.json '
               f'vocab_size is {m.vocab_size}')
  return changed


# -- tensors ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tensor:
  """One Hugging Face tensor and the parameter it becomes.

  kind: 'copy' (same layout), 'T' (a torch Linear [out, in] -> kernel [in, out]),
  'in_heads' (q/k/v [heads*head_dim, d] -> [d, heads, head_dim]), 'out_heads'
  (o [d, heads*head_dim] -> [heads, head_dim, d]), 'bias_heads' ([heads*head_dim] ->
  [heads, head_dim]).
  """
  name: str
  path: tuple  # the parameter's path in the model's nnx.State, without the 'value' leaf
  kind: str
  shape: tuple  # the Hugging Face (torch) shape


def tensor_table(args: ModelArgs) -> list[Tensor]:
  """Every tensor a dense Llama-family causal LM of `args` holds (the trunk only)."""
  d, n, k, h, f, v = (args.d_model, args.n_heads, args.n_kv_heads, args.head_dim,
                      args.mlp_dim, args.vocab_size)
  out = [Tensor('model.embed_tokens.weight', ('embed', 'embedding'), 'copy', (v, d)),
         Tensor('model.norm.weight', ('norm', 'scale'), 'copy', (d,))]
  if not args.tie_embeddings:
    out.append(Tensor('lm_head.weight', ('lm_head', 'kernel'), 'T', (v, d)))
  for i in range(args.n_layers):
    pre, at = f'model.layers.{i}', ('layers', str(i))
    out += [Tensor(f'{pre}.input_layernorm.weight', at + ('input_layernorm', 'scale'), 'copy', (d,)),
            Tensor(f'{pre}.post_attention_layernorm.weight',
                   at + ('post_attention_layernorm', 'scale'), 'copy', (d,)),
            Tensor(f'{pre}.self_attn.o_proj.weight', at + ('self_attn', 'o_proj', 'kernel'),
                   'out_heads', (d, n * h))]
    for name, heads in (('q_proj', n), ('k_proj', k), ('v_proj', k)):
      out.append(Tensor(f'{pre}.self_attn.{name}.weight', at + ('self_attn', name, 'kernel'),
                        'in_heads', (heads * h, d)))
      if args.attention_bias:
        out.append(Tensor(f'{pre}.self_attn.{name}.bias', at + ('self_attn', name, 'bias'),
                          'bias_heads', (heads * h,)))
    for name, shape in (('gate_proj', (f, d)), ('up_proj', (f, d)), ('down_proj', (d, f))):
      out.append(Tensor(f'{pre}.mlp.{name}.weight', at + ('mlp', name, 'kernel'), 'T', shape))
  return out


def _files(directory: str) -> list[str]:
  """The safetensors files of DIR: those its index names, else every *.safetensors."""
  index = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.isfile(index):
    try:
      with open(index, encoding='utf-8') as f:
        weight_map = json.load(f)['weight_map']
      names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
      raise _err(directory, f'model.safetensors.index.json has no readable weight_map ({e})') from e
    for n in names:
      if not os.path.isfile(os.path.join(directory, n)):
        raise _err(directory, f'model.safetensors.index.json names {n}, which is missing')
    return names
  names = sorted(n for n in os.listdir(directory) if n.endswith('.safetensors'))
  if not names:
    raise _err(directory, 'no *.safetensors weights in the directory (.bin / .pt '
               'checkpoints are not read)')
  return names


def tensor_index(directory: str) -> dict:
  """{tensor name: (file, shape, dtype)} from the safetensors headers (no weight is read)."""
  out = {}
  for name in _files(directory):
    path = os.path.join(directory, name)
    try:
      with safe_open(path, framework='flax') as f:
        for key in f.keys():
          sl = f.get_slice(key)
          out[key] = (path, tuple(sl.get_shape()), sl.get_dtype())
    except Exception as e:  # pylint: disable=broad-except  (safetensors raises its own kinds)
      raise _err(directory, f'{name} is not a readable safetensors file '
                 f'({" ".join(str(e).split())[:200]})') from e
  return out


_FLOAT_DTYPES = ('F32', 'BF16', 'F16')


def check_weights(directory: str, args: ModelArgs) -> dict:
  """{name: (file, shape, dtype)} of the tensors to load, once every one is known to be
  there with the shape config.json implies and nothing unknown is left; ConfigError
  naming the tensor otherwise."""
  index = tensor_index(directory)
  table = tensor_table(args)
  for t in table:
    if t.name not in index:
      raise _err(directory, f'tensor {t.name} is missing from the safetensors files')
    _, shape, dtype = index[t.name]
    if shape != t.shape:
      raise _err(directory, f'tensor {t.name} has shape {list(shape)} but config.json '
                 f'implies {list(t.shape)} (hidden_size {args.d_model}, heads {args.n_heads}, '
                 f'kv heads {args.n_kv_heads}, head_dim {args.head_dim}, intermediate_size '
                 f'{args.mlp_dim}, vocab_size {args.vocab_size})')
    if dtype not in _FLOAT_DTYPES:
      raise _err(directory, f'tensor {t.name} has dtype {dtype}; only {_FLOAT_DTYPES} are read')
  wanted = {t.name for t in table}
  if args.tie_embeddings:
    wanted.add('lm_head.weight')  # a tied model may store its head anyway; transformers ignores it
  extra = sorted(n for n in index if n not in wanted and not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    more = f' and {len(extra) - 3} more' if len(extra) > 3 else ''
    raise _err(directory, f'unexpected tensor {", ".join(extra[:3])}{more}: not part of a '
               f'{args.n_layers}-layer model as config.json describes it')
  return {t.name: index[t.name] for t in table}


def _rows(s: slice, size: int, h: int) -> slice:
  """Rows [a*h, b*h) of a [heads*h, ...] tensor for head slice s = [a, b)."""
  a, b, _ = s.indices(size)
  return slice(a * h, b * h)


def _shard(sl, t: Tensor, index: tuple, target_shape: tuple) -> np.ndarray:
  """The block `index` of parameter `t` read from the file slice `sl` (torch layout)."""
  if t.kind == 'copy':
    return np.asarray(sl[index])
  if t.kind == 'T':
    return np.asarray(sl[index[1], index[0]]).T
  if t.kind == 'in_heads':  # [d, n, h] <- W[n*h, d]
    sd, sn, sh = index
    d, n, h = target_shape
    block = np.asarray(sl[_rows(sn, n, h), sd]).T
    return block.reshape(block.shape[0], -1, h)[:, :, sh]
  if t.kind == 'out_heads':  # [n, h, d] <- W[d, n*h]
    sn, sh, sd = index
    n, h, d = target_shape
    block = np.asarray(sl[sd, _rows(sn, n, h)]).T
    return block.reshape(-1, h, block.shape[1])[:, sh, :]
  if t.kind == 'bias_heads':  # [n, h] <- b[n*h]
    sn, sh = index
    n, h = target_shape
    return np.asarray(sl[_rows(sn, n, h)]).reshape(-1, h)[:, sh]
  raise ValueError(f'unknown tensor kind {t.kind!r}')


def load_into(directory: str, args: ModelArgs, targets: dict) -> dict:
  """{path: jax.Array} for the trunk parameters, each built on its target's sharding.

  targets: {path (as in Tensor.path): jax.ShapeDtypeStruct with a sharding}. Every
  device's block is read from the file on its own (make_array_from_callback), float32
  (or the target dtype) from F32 / BF16 / F16.
  """
  files = check_weights(directory, args)
  cpu = jax.local_devices(backend='cpu')[0]  # safetensors' flax reader makes jax arrays: on the host
  out = {}
  opened = {}
  try:
    for t in tensor_table(args):
      target = targets[t.path]
      path = files[t.name][0]
      if path not in opened:
        with jax.default_device(cpu):
          opened[path] = safe_open(path, framework='flax')
      sl = opened[path].get_slice(t.name)
      blocks = {}  # devices holding the same block (replicas) share one read

      def block(index, sl=sl, t=t, target=target, blocks=blocks):
        key = str(index)
        if key not in blocks:
          with jax.default_device(cpu):
            blocks[key] = _shard(sl, t, index, target.shape).astype(target.dtype)
        return blocks[key]

      out[t.path] = jax.make_array_from_callback(target.shape, target.sharding, block)
  finally:
    for f in opened.values():
      f.__exit__(None, None, None)
  return out


def describe(directory: str, args: ModelArgs, loaded: int) -> str:
  fresh = f'{args.mtp_depth} MTP depth(s) freshly initialised; ' if args.mtp_depth else ''
  return (f'Initialised from hf:{directory}: trunk, embedding and head loaded ({loaded} '
          f'tensors); {fresh}optimizer, step and data start fresh.')


def _key(k) -> str:
  for attr in ('key', 'idx', 'name'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def init_state(directory: str, config, state, notify=print):
  """The train state (model, optimizer) with the trunk replaced by DIR's weights.

  Every loaded array takes the sharding of the leaf it replaces; the MTP modules and
  the optimizer state stay as they are (fresh). Returns (state, description).
  """
  args = ModelArgs.from_config(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  paths = [tuple(_key(k) for k in p) for p, _ in flat]
  # The model half of the (model, optimizer) state: ('0', ..., 'value').
  targets = {p[1:-1]: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
             for p, (_, x) in zip(paths, flat) if p[0] == '0'}
  loaded = load_into(directory, args, targets)
  leaves = [loaded.get(p[1:-1], x) if p[0] == '0' else x for p, (_, x) in zip(paths, flat)]
  desc = describe(directory, args, len(loaded))
  notify(desc)
  return jax.tree_util.tree_unflatten(treedef, leaves), desc


def load_model(directory: str, config) -> MTPModel:
  """An MTPModel on this process's first device: DIR's trunk, fresh MTP modules.

  config: a config on which apply_to_config(config, DIR) has run (the MTP fields are
  its own). For decoding and tests; training goes through init_state.
  """
  args = ModelArgs.from_config(config)
  model = MTPModel(args, rngs=nnx.Rngs(config.seed))
  graphdef, state = nnx.split(model)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  paths = [tuple(_key(k) for k in p)[:-1] for p, _ in flat]  # without the 'value' leaf
  targets = {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
             for p, (_, x) in zip(paths, flat)}
  loaded = load_into(directory, args, targets)
  leaves = [loaded.get(p, x) for p, (_, x) in zip(paths, flat)]
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
