"""config.json <-> config.model: one table of the hyper-parameters, one mapper per family.

Families, by config.json's `architectures`: llama, mistral, qwen2 (dense GQA + SwiGLU
trunks with Llama's tensor names), deepseek_v3 (MLA, DeepSeekMoE, FP8 block scales, MTP
layers) and mimo (Xiaomi MiMo: a Qwen2 trunk with MTP layers). `HPARAMS` is the one place
that names a model hyper-parameter three ways (ModelArgs, config.model, config.json);
`model_fields` reads a config.json through it, `to_hf` writes one. It sees config.json as a
dict only: the directory is hf.py's (reading) and export.py's (writing). Every refusal is one
InteropError line naming the field.
"""
from __future__ import annotations

import dataclasses

import mtp_jax
import mtp_jax.interop.fp8 as fp8_lib
from mtp_jax.config.base import base_config
from mtp_jax.interop.safetensors_io import InteropError

# architectures entry -> family
ARCHITECTURES = {'LlamaForCausalLM': 'llama', 'MistralForCausalLM': 'mistral',
                 'Qwen2ForCausalLM': 'qwen2', 'DeepseekV3ForCausalLM': 'deepseek_v3',
                 'MiMoForCausalLM': 'mimo'}
# Why some well-known ones are refused (anything else is refused as unknown).
NOT_SUPPORTED = {
    'DeepseekV2ForCausalLM': 'its MoE routing is softmax top-k, this project routes by sigmoid',
    'MixtralForCausalLM': "Mixtral's MoE has no shared experts and softmax routing",
    'Qwen2MoeForCausalLM': "Qwen2-MoE's shared-expert gate is not built here",
    'Qwen3ForCausalLM': "Qwen3 has q/k norms, which this project's attention lacks",
    'GemmaForCausalLM': 'Gemma scales embeddings and offsets its norms',
}
# Export layouts: a Llama-family trunk (Qwen2 when the model has q/k/v biases), or with
# the MTP modules in DeepSeek-V3's or MiMo's names.
LAYOUTS = ('llama', 'deepseek_v3', 'mimo')
LAYOUT_OF = {'llama': 'llama', 'mistral': 'llama', 'qwen2': 'llama',
             'deepseek_v3': 'deepseek_v3', 'mimo': 'mimo'}
_GQA = ('llama', 'mistral', 'qwen2', 'mimo')
_ALL = _GQA + ('deepseek_v3',)
_V3 = ('deepseek_v3',)
_MTP = ('deepseek_v3', 'mimo')
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class HParam:
  """One hyper-parameter: its ModelArgs name, config.model field and config.json key."""
  arg: str
  field: str  # dotted below config.model
  key: str
  families: tuple
  kind: type = int
  default: object = _REQUIRED  # when config.json lacks the key (or holds null)
  positive: bool = True  # ints: > 0 (else >= 0)
  moe_only: bool = False  # read only when the checkpoint has MoE layers


HPARAMS = (
    HParam('vocab_size', 'vocab_size', 'vocab_size', _ALL),
    HParam('d_model', 'd_model', 'hidden_size', _ALL),
    HParam('n_layers', 'n_layers', 'num_hidden_layers', _ALL),
    HParam('n_heads', 'n_heads', 'num_attention_heads', _ALL),
    HParam('mlp_dim', 'mlp_dim', 'intermediate_size', _ALL),
    HParam('norm_eps', 'norm_eps', 'rms_norm_eps', _ALL, float, 1e-6),
    HParam('tie_embeddings', 'tie_embeddings', 'tie_word_embeddings', _ALL, bool, False),
    HParam('n_kv_heads', 'n_kv_heads', 'num_key_value_heads', _GQA, int, None),  # None: heads
    HParam('head_dim', 'head_dim', 'head_dim', _GQA, int, None),  # None: hidden / heads
    HParam('mtp_depth', 'mtp.depth', 'num_nextn_predict_layers', _MTP, int, 0, False),
    HParam('q_lora_rank', 'mla.q_lora_rank', 'q_lora_rank', _V3, int, 0, False),
    HParam('kv_lora_rank', 'mla.kv_lora_rank', 'kv_lora_rank', _V3),
    HParam('qk_nope_head_dim', 'mla.qk_nope_head_dim', 'qk_nope_head_dim', _V3),
    HParam('qk_rope_head_dim', 'mla.qk_rope_head_dim', 'qk_rope_head_dim', _V3),
    HParam('v_head_dim', 'mla.v_head_dim', 'v_head_dim', _V3),
    HParam('first_k_dense', 'moe.first_k_dense', 'first_k_dense_replace', _V3, int, 0, False),
    HParam('n_routed_experts', 'moe.n_routed_experts', 'n_routed_experts', _V3, int, 0, False),
    HParam('n_shared_experts', 'moe.n_shared_experts', 'n_shared_experts', _V3, int, 0, False,
           True),
    HParam('num_experts_per_tok', 'moe.num_experts_per_tok', 'num_experts_per_tok', _V3,
           moe_only=True),
    HParam('moe_intermediate_size', 'moe.moe_intermediate_size', 'moe_intermediate_size', _V3,
           moe_only=True),
    HParam('routed_scaling_factor', 'moe.routed_scaling_factor', 'routed_scaling_factor', _V3,
           float, 1.0, moe_only=True),
    HParam('n_group', 'moe.n_group', 'n_group', _V3, int, 1, moe_only=True),
    HParam('topk_group', 'moe.topk_group', 'topk_group', _V3, int, None, moe_only=True),
)
BY_KEY = {p.key: p for p in HPARAMS}
# DeepSeekMoE settings this project implements; config.json must agree.
_V3_FIXED = (('scoring_func', 'sigmoid'), ('topk_method', 'noaux_tc'), ('norm_topk_prob', True),
             ('moe_layer_freq', 1))


def _err(where: str, text: str) -> InteropError:
  return InteropError(f'{where}: {text}')


def family_of(cfg: dict, where: str) -> str:
  """The family of a config.json, by its one `architectures` entry."""
  arch = cfg.get('architectures')
  if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
    raise _err(where, f'config.json architectures must list one model class, got {arch!r}')
  name = arch[0]
  if name in ARCHITECTURES:
    return ARCHITECTURES[name]
  why = NOT_SUPPORTED.get(name, 'unknown architecture')
  raise _err(where, f'config.json architectures {name!r} is not supported ({why}); '
             f'supported: {", ".join(ARCHITECTURES)}')


def _value(cfg: dict, p: HParam, where: str, default=None):
  value = cfg.get(p.key)
  if value is None:
    value = p.default if default is None else default
  if value is _REQUIRED:
    raise _err(where, f'config.json lacks {p.key!r}')
  if p.kind is bool:
    if not isinstance(value, bool):
      raise _err(where, f'config.json {p.key} must be true or false, got {value!r}')
    return value
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if p.kind is int and not (number and float(value).is_integer()):
    raise _err(where, f'config.json {p.key} must be an integer, got {value!r}')
  if not number or value < 0 or (p.positive and value <= 0):
    sign = 'positive' if p.positive else 'non-negative'
    raise _err(where, f'config.json {p.key} must be a {sign} number, got {value!r}')
  return p.kind(value)


def _rope(cfg: dict, where: str) -> tuple[float, dict]:
  """(rope_theta, model.rope_scaling fields) from transformers 5's rope_parameters or the
  older rope_theta + rope_scaling."""
  params = cfg.get('rope_parameters')
  field = 'rope_parameters'
  if params is None:
    params, field = dict(cfg.get('rope_scaling') or {}), 'rope_scaling'
    params.setdefault('rope_theta', cfg.get('rope_theta', 10000.0))
  if not isinstance(params, dict):
    raise _err(where, f'config.json {field} must be an object, got {params!r}')
  if isinstance(params.get('full_attention'), dict):
    params = params['full_attention']  # per-layer-type parameters (transformers 5)
  theta = params.get('rope_theta', cfg.get('rope_theta', 10000.0))
  if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
    raise _err(where, f'config.json {field}.rope_theta must be > 0, got {theta!r}')
  kind = params.get('rope_type', params.get('type', 'default')) or 'default'
  if cfg.get('partial_rotary_factor', params.get('partial_rotary_factor', 1.0)) != 1.0:
    raise _err(where, 'config.json partial_rotary_factor != 1 is not supported')

  def num(name, default=None):
    v = params.get(name, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
      raise _err(where, f'config.json {field}.{name} must be a positive number, got {v!r}')
    return v

  if kind == 'default':
    return float(theta), {'kind': ''}
  if kind == 'linear':
    return float(theta), {'kind': 'linear', 'factor': float(num('factor'))}
  if kind == 'llama3':
    return float(theta), {'kind': 'llama3', 'factor': float(num('factor')),
                          'low_freq_factor': float(num('low_freq_factor', 1.0)),
                          'high_freq_factor': float(num('high_freq_factor', 4.0)),
                          'original_max_positions': int(num('original_max_position_embeddings'))}
  raise _err(where, f'config.json {field}.rope_type {kind!r} is not supported '
             '(supported: default, linear, llama3)')


def model_fields(cfg: dict, where: str) -> tuple[str, dict]:
  """(family, {config.model field (dotted): value}) of a config.json; rope_scaling is a
  dict of model.rope_scaling fields and mtp.depth the checkpoint's MTP layers (0 for a
  plain causal LM)."""
  family = family_of(cfg, where)
  act = cfg.get('hidden_act', cfg.get('hidden_activation', 'silu'))
  if act != 'silu':
    raise _err(where, f"config.json hidden_act must be 'silu' (SwiGLU), got {act!r}")
  if cfg.get('mlp_bias'):
    raise _err(where, 'config.json mlp_bias=true is not supported (bias-free SwiGLU only)')
  quant = cfg.get('quantization_config')
  if quant and (family != 'deepseek_v3' or quant.get('quant_method') != 'fp8'
                or list(quant.get('weight_block_size') or []) != [fp8_lib.BLOCK] * 2):
    raise _err(where, 'config.json quantization_config: only DeepSeek-V3\'s FP8 '
               f'(quant_method fp8, weight_block_size [{fp8_lib.BLOCK}, {fp8_lib.BLOCK}]) is '
               'read; give float32 / bfloat16 / float16 safetensors otherwise')
  moe_layers = False
  if family == 'deepseek_v3':
    experts = _value(cfg, BY_KEY['n_routed_experts'], where)
    first = _value(cfg, BY_KEY['first_k_dense_replace'], where)
    layers = (_value(cfg, BY_KEY['num_hidden_layers'], where)
              + max(_value(cfg, BY_KEY['num_nextn_predict_layers'], where), 1))
    moe_layers = experts > 0 and first < layers
  out = {}
  for p in HPARAMS:
    if family not in p.families or (p.moe_only and not moe_layers):
      continue
    default = None
    if p.key == 'num_key_value_heads':
      default = out['n_heads']
    elif p.key == 'head_dim':
      d, n = out['d_model'], out['n_heads']
      if d % n and cfg.get('head_dim') is None:
        raise _err(where, f'config.json hidden_size ({d}) is not divisible by '
                   f'num_attention_heads ({n}) and no head_dim is given')
      default = d // n
    elif p.key == 'topk_group':
      default = out['moe.n_group']
    out[p.field] = _value(cfg, p, where, default)
  theta, scaling = _rope(cfg, where)
  out['rope_theta'], out['rope_scaling'] = theta, scaling
  if cfg.get('max_position_embeddings') is not None:
    out['max_positions'] = _value(cfg, HParam('', '', 'max_position_embeddings', _ALL), where)
  else:
    out['max_positions'] = 0
  out.setdefault('mtp.depth', 0)
  if family == 'deepseek_v3':
    return family, _deepseek_v3(cfg, out, moe_layers, scaling, where)
  heads, kv = out['n_heads'], out['n_kv_heads']
  if heads % kv:
    raise _err(where, f'config.json num_attention_heads ({heads}) must be a multiple of '
               f'num_key_value_heads ({kv})')
  if out['head_dim'] % 2:
    raise _err(where, f'config.json head_dim must be even for RoPE, got {out["head_dim"]}')
  if family in ('llama', 'mistral') and cfg.get('attention_bias'):
    # Llama's attention_bias also puts a bias on o_proj, which this attention lacks.
    raise _err(where, 'config.json attention_bias=true (q/k/v/o biases) is not supported '
               'for Llama / Mistral; Qwen2-style q/k/v biases are')
  # Qwen2 always has q/k/v biases; a mimo export says attention_bias=false when they are 0.
  out['attention_bias'] = family == 'qwen2' or (family == 'mimo'
                                                and cfg.get('attention_bias', True) is not False)
  # Sliding-window attention equals full attention on sequences no longer than the
  # window, so a model with one is loaded with max_positions capped at the window.
  layer_types = cfg.get('layer_types') or []
  if cfg.get('sliding_window') is not None and (
      family == 'mistral' or cfg.get('use_sliding_window') or 'sliding_attention' in layer_types):
    window = _value(cfg, HParam('', '', 'sliding_window', _ALL), where)
    out['max_positions'] = min(out['max_positions'], window) if out['max_positions'] else window
  out.update(attention='gqa', mlp='dense')
  return family, out


def _deepseek_v3(cfg: dict, out: dict, moe_layers: bool, scaling: dict, where: str) -> dict:
  if cfg.get('attention_bias'):
    raise _err(where, 'config.json attention_bias=true: MLA here has no biases')
  if scaling['kind']:
    raise _err(where, f"config.json rope scaling {scaling['kind']!r} is not supported for "
               "MLA (this project's MLA RoPE is unscaled)")
  out.update(attention='mla', mlp='moe' if moe_layers else 'dense', attention_bias=False)
  if not moe_layers:
    return out
  for name, want in _V3_FIXED:
    got = cfg.get(name, want)
    if got != want:
      raise _err(where, f'config.json {name}={got!r}: only {want!r} is implemented')
  if out['moe.topk_group'] == out['moe.n_group']:  # every group allowed: plain top-k
    out['moe.n_group'] = out['moe.topk_group'] = 1
  return out


def set_fields(model_config, fields: dict) -> list[str]:
  """Writes model_fields' values into config.model; 'field: old -> new' for each change."""
  changed = []

  def put(node, name, value, dotted):
    if node[name] != value:
      changed.append(f'{dotted}: {node[name]!r} -> {value!r}')
      node[name] = value

  for dotted, value in fields.items():
    if dotted == 'rope_scaling':
      defaults = {'kind': '', 'factor': 1.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                  'original_max_positions': 8192}
      for name in model_config.rope_scaling.keys():
        put(model_config.rope_scaling, name, value.get(name, defaults.get(name)),
            f'model.rope_scaling.{name}')
      continue
    node, parts = model_config, dotted.split('.')
    for part in parts[:-1]:
      node = node[part]
    put(node, parts[-1], value, f'model.{dotted}')
  return changed


def to_config(cfg: dict, where: str = 'config.json', base=None):
  """A config (base_config() or `base`) whose model is exactly the one config.json
  describes: its MTP layers are the model's MTP depths (none for a plain causal LM)."""
  family, fields = model_fields(cfg, where)
  if family in ('deepseek_v3', 'mimo'):
    fields.update({'mtp.kind': 'sequential', 'mtp.block_attention': '', 'mtp.block_mlp': ''})
  else:
    fields['mtp.depth'] = 0
  config = base_config() if base is None else base
  set_fields(config.model, fields)
  return config


def family_for(args, layout: str) -> str:
  """The family a model is exported as: the layout's, Qwen2 for a biased llama trunk."""
  if layout == 'llama':
    return 'qwen2' if args.attention_bias else 'llama'
  return layout


def _rope_out(args) -> dict:
  if not args.rope_scaling:
    return {'rope_theta': args.rope_theta, 'rope_scaling': None}
  kind = args.rope_scaling[0]
  scaling = {'rope_type': kind, 'factor': float(args.rope_scaling[1])}
  if kind == 'llama3':
    _, _, low, high, original = args.rope_scaling
    scaling.update(low_freq_factor=float(low), high_freq_factor=float(high),
                   original_max_position_embeddings=int(original))
  return {'rope_theta': args.rope_theta, 'rope_scaling': scaling}


def to_hf(args, layout: str, *, max_positions: int = 4096, fp8: bool = False,
          tokens: dict | None = None) -> dict:
  """config.json of an export: the family's fields from HPARAMS plus its constants.

  tokens: {'bos_token_id', 'eos_token_id', 'pad_token_id'} of the tokenizer (None: none).
  """
  family = family_for(args, layout)
  c = {}
  for p in HPARAMS:
    if family in p.families:
      c[p.key] = getattr(args, p.arg)
  c.update(_rope_out(args), hidden_act='silu', max_position_embeddings=int(max_positions),
           torch_dtype='float32', attention_dropout=0.0, initializer_range=args.init_std,
           use_cache=True, **(tokens or {}))
  if family == 'llama':
    c.update(architectures=['LlamaForCausalLM'], model_type='llama', attention_bias=False,
             mlp_bias=False)
  elif family in ('qwen2', 'mimo'):
    # MiMo's MTP layers ride on a Qwen2 trunk: model_type qwen2 makes transformers'
    # AutoModelForCausalLM build that trunk (the MTP layers are names it skips), while
    # the MiMoForCausalLM architecture tells serving engines and this importer what they
    # are. attention_bias: whether the q/k/v biases are the model's own or zeros.
    c.update(architectures=['MiMoForCausalLM' if family == 'mimo' else 'Qwen2ForCausalLM'],
             model_type='qwen2', use_sliding_window=False, sliding_window=None,
             max_window_layers=args.n_layers, attention_bias=bool(args.attention_bias))
  else:
    moe_layers = args.mlp == 'moe'
    c.update(architectures=['DeepseekV3ForCausalLM'], model_type='deepseek_v3',
             num_key_value_heads=args.n_heads, q_lora_rank=args.q_lora_rank or None,
             rope_interleave=True, attention_bias=False,
             # dense everywhere: no layer (MTP's included) reaches first_k_dense_replace
             first_k_dense_replace=(args.first_k_dense if moe_layers
                                    else args.n_layers + max(args.mtp_depth, 1)),
             moe_layer_freq=1, scoring_func='sigmoid', topk_method='noaux_tc',
             norm_topk_prob=True)
  if fp8:
    c['quantization_config'] = fp8_lib.quantization_config()
  return c


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
