"""This project's models <-> Hugging Face-layout directories (safetensors + config.json).

Two layouts of the MTP modules, the ones serving engines load:

deepseek_v3  DeepSeek-V3's release (README_WEIGHTS.md of github.com/deepseek-ai/DeepSeek-V3):
  trunk layer i at `model.layers.{i}`; MTP depth k at decoder layer `num_hidden_layers + k - 1`
  with `enorm`, `hnorm`, `eh_proj` (acting on [enorm(emb) ; hnorm(h)]), the block's usual
  names, `shared_head.norm`, and copies of the shared `embed_tokens` and `shared_head.head`
  (vLLM's vllm/model_executor/models/deepseek_mtp.py loads `shared_head.head` per MTP layer
  and the first MTP layer's `embed_tokens`; DeepSeek's inference/convert.py skips layer 61).
  Blocks are MLA (`self_attn.q_a_proj / q_a_layernorm / q_b_proj`, or `q_proj` when
  q_lora_rank is None, `kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj`) and a
  dense SwiGLU (`mlp.{gate,up,down}_proj`) in the first `first_k_dense_replace` layers,
  DeepSeekMoE after (`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
  `mlp.experts.{j}.{gate,up,down}_proj`, `mlp.shared_experts.{gate,up,down}_proj`); the leaf
  names are the keys of the `mapping` table in DeepSeek's inference/convert.py. FP8: the
  release stores the decoder layers' projection weights as float8_e4m3fn with a float32
  `weight_scale_inv` per 128 x 128 block (dequantised on load; optional on export); norms,
  `mlp.gate.weight`, `eh_proj`, the embedding and the heads stay in a wide type.
mimo  Xiaomi MiMo's MTP layers on a Qwen2 trunk, as vLLM's
  vllm/model_executor/models/mimo_mtp.py and SGLang's python/sglang/srt/models/mimo_mtp.py
  load them: depth k at `model.mtp_layers.{k-1}` with `token_layernorm` (= enorm),
  `hidden_layernorm` (= hnorm), `input_proj` acting on [hidden_layernorm(h) ;
  token_layernorm(emb)] (the opposite order of DeepSeek's eh_proj: its column halves are
  swapped), a Qwen2 decoder layer's names directly under the prefix, and `final_layernorm`
  (= shared_head.norm); embedding and head are the trunk's. Qwen2's q/k/v projections have
  biases: the model's own when it has them (model.attention_bias, e.g. an hf: Qwen2 trunk,
  flagged by attention_bias=true in config.json), otherwise zeros, which must be zero on load.

RoPE: this project rotates in the rotate-half form (layers.apply_rope); DeepSeek's weights
keep each rotary pair (x_2i, x_2i+1) adjacent (inference/model.py's apply_rotary_emb views
them as complex numbers; transformers' DeepseekV3 calls that `rope_interleave`). The rotary
output rows of q_b_proj / q_proj (per head) and of kv_a_proj_with_mqa are permuted on load
and back on export, so both compute the same attention. Qwen2 / Llama HF weights are
rotate-half already (no permutation).

Torch `Linear.weight` is [out, in]; Flax kernels are [in, out] (heads split out).
"""
from __future__ import annotations

import json
import math
import os

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib
from mtp_jax.model import layers
from mtp_jax.model import mla
from mtp_jax.model import moe
from mtp_jax.model import state as state_lib
from mtp_jax.model.mtp import MTPModel, ModelArgs, block_classes

LAYOUTS = ('deepseek_v3', 'mimo')
FP8_BLOCK = 128  # DeepSeek-V3's weight quantisation blocks: 128 x 128 per weight_scale_inv entry
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
SHARD_BYTES = 4 << 30  # safetensors shard size on export (transformers' default is 5 GB)


class ConvertError(ValueError):
  """A checkpoint or request that cannot be converted; the message names the tensor or
  field (CLI exit code 2)."""
  exit_code = 2


# -- FP8 ----------------------------------------------------------------------------------
def dequantize_fp8(weight_OxI: np.ndarray, scale_inv_PxQ: np.ndarray,
                   block: int = FP8_BLOCK) -> np.ndarray:
  """float32 weight of a DeepSeek-V3 FP8 (e4m3) tensor and its `weight_scale_inv`.

  Entry [p, q] of scale_inv multiplies block rows p*block.., columns q*block.. (the last
  blocks may be partial: scale_inv is [ceil(O / block), ceil(I / block)]), as DeepSeek's
  own `weight_dequant` (inference/kernel.py).
  """
  o, i = weight_OxI.shape
  want = (-(-o // block), -(-i // block))
  if scale_inv_PxQ.shape != want:
    raise ValueError(f'weight_scale_inv has shape {scale_inv_PxQ.shape}, expected {want} '
                     f'for a {weight_OxI.shape} weight in {block} x {block} blocks')
  scale = np.repeat(np.repeat(scale_inv_PxQ.astype(np.float32), block, 0), block, 1)
  return weight_OxI.astype(np.float32) * scale[:o, :i]


def quantize_fp8(w_OxI: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
  """(float8_e4m3fn weight, float32 weight_scale_inv): each block's largest |w| maps to 448.

  README_WEIGHTS.md: a partial block is zero-padded to 128 before its scale is taken, which
  leaves its max |w| unchanged; an all-zero block gets scale 1.
  """
  o, i = w_OxI.shape
  p, q = -(-o // block), -(-i // block)
  padded = np.zeros((p * block, q * block), np.float32)
  padded[:o, :i] = w_OxI
  amax_PxQ = np.abs(padded.reshape(p, block, q, block)).max(axis=(1, 3))
  scale_PxQ = np.where(amax_PxQ > 0, amax_PxQ / E4M3_MAX, 1.0).astype(np.float32)
  full = np.repeat(np.repeat(scale_PxQ, block, 0), block, 1)[:o, :i]
  return (w_OxI / full).astype(ml_dtypes.float8_e4m3fn), scale_PxQ


FP8_PROJECTIONS = ('q_proj', 'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj',
                   'gate_proj', 'up_proj', 'down_proj')


def _fp8_in_release(name: str) -> bool:
  """Whether DeepSeek-V3's release stores this tensor as FP8 + weight_scale_inv: the
  projection weights of the decoder layers (attention, dense MLP, experts, shared experts),
  not the router (mlp.gate), eh_proj, the embedding or the heads."""
  parts = name.split('.')
  return name.startswith('model.layers.') and parts[-1] == 'weight' and parts[-2] in FP8_PROJECTIONS


# -- RoPE row order -----------------------------------------------------------------------
def _pairs_to_half(dr: int) -> np.ndarray:
  """Index p with half = pairs[..., p]: rotate-half slot j < dr/2 is pair element 2j,
  slot dr/2 + j is 2j + 1 (both rotate by frequency j)."""
  return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])


def _permute_tail(x: np.ndarray, start: int, order: np.ndarray) -> np.ndarray:
  """x with its last axis' entries start.. reordered by `order`."""
  idx = np.concatenate([np.arange(start), start + order])
  return x[..., idx]


def rope_to_half(x: np.ndarray, start: int) -> np.ndarray:
  """Interleaved rotary entries [start:] of the last axis -> this project's rotate-half."""
  return _permute_tail(x, start, _pairs_to_half(x.shape[-1] - start))


def rope_to_pairs(x: np.ndarray, start: int) -> np.ndarray:
  """The inverse of rope_to_half."""
  return _permute_tail(x, start, np.argsort(_pairs_to_half(x.shape[-1] - start)))


# -- one block: project pure dict <-> HF names ---------------------------------------------
def _t(kernel_IxO) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(kernel_IxO).T)


def _attn_to_hf(a: dict, args: ModelArgs, kind, zero_bias: bool) -> dict:
  d = args.d_model
  if kind is layers.Attention:
    out = {'q_proj.weight': _t(a['q_proj']['kernel'].reshape(d, -1)),
           'k_proj.weight': _t(a['k_proj']['kernel'].reshape(d, -1)),
           'v_proj.weight': _t(a['v_proj']['kernel'].reshape(d, -1)),
           'o_proj.weight': _t(a['o_proj']['kernel'].reshape(-1, d))}
    if zero_bias:  # Qwen2's attention biases: the model's own (an hf: Qwen2 trunk), or zeros
      for name in ('q', 'k', 'v'):
        b = a[f'{name}_proj'].get('bias')
        out[f'{name}_proj.bias'] = (np.zeros(out[f'{name}_proj.weight'].shape[0], np.float32)
                                    if b is None else np.asarray(b).reshape(-1))
    return out
  dn, kvr = args.qk_nope_head_dim, args.kv_lora_rank
  out = {}
  if args.q_lora_rank:
    out['q_a_proj.weight'] = _t(a['q_a_proj']['kernel'])
    out['q_a_layernorm.weight'] = np.asarray(a['q_a_layernorm']['scale'])
    qb = rope_to_pairs(np.asarray(a['q_b_proj']['kernel']), dn)
    out['q_b_proj.weight'] = _t(qb.reshape(qb.shape[0], -1))
  else:
    q = rope_to_pairs(np.asarray(a['q_proj']['kernel']), dn)
    out['q_proj.weight'] = _t(q.reshape(d, -1))
  out['kv_a_proj_with_mqa.weight'] = _t(rope_to_pairs(np.asarray(a['kv_a_proj_with_mqa']['kernel']), kvr))
  out['kv_a_layernorm.weight'] = np.asarray(a['kv_a_layernorm']['scale'])
  out['kv_b_proj.weight'] = _t(a['kv_b_proj']['kernel'].reshape(kvr, -1))
  out['o_proj.weight'] = _t(a['o_proj']['kernel'].reshape(-1, d))
  return out


def _swiglu_to_hf(m: dict) -> dict:
  return {f'{p}.weight': _t(m[p]['kernel']) for p in ('gate_proj', 'up_proj', 'down_proj')}


def _mlp_to_hf(m: dict, kind) -> dict:
  if kind is layers.MLP:
    return _swiglu_to_hf(m)
  out = {'gate.weight': _t(m['gate']['kernel']),
         'gate.e_score_correction_bias': np.asarray(m['gate']['e_score_correction_bias'])}
  ex = m['experts']
  for j in range(ex['gate_proj'].shape[0]):
    for p in ('gate_proj', 'up_proj', 'down_proj'):
      out[f'experts.{j}.{p}.weight'] = _t(ex[p][j])
  if m.get('shared_experts'):
    out.update({f'shared_experts.{k}': v for k, v in _swiglu_to_hf(m['shared_experts']).items()})
  return out


def _block_to_hf(p: dict, prefix: str, args: ModelArgs, layer: int, zero_bias: bool) -> dict:
  attn_cls, mlp_cls = block_classes(args, layer)
  out = {f'{prefix}.input_layernorm.weight': np.asarray(p['input_layernorm']['scale']),
         f'{prefix}.post_attention_layernorm.weight':
             np.asarray(p['post_attention_layernorm']['scale'])}
  out.update({f'{prefix}.self_attn.{k}': v
              for k, v in _attn_to_hf(p['self_attn'], args, attn_cls, zero_bias).items()})
  out.update({f'{prefix}.mlp.{k}': v for k, v in _mlp_to_hf(p['mlp'], mlp_cls).items()})
  return out


class _Source:
  """Tensors by name with expected shapes; remembers which were used; FP8 dequantised."""

  def __init__(self, tensors, where: str):
    self.tensors, self.where, self.used = tensors, where, set()

  def __contains__(self, name):
    return name in self.tensors

  def get(self, name: str, *shape: int) -> np.ndarray:
    if name not in self.tensors:
      raise ConvertError(f'{self.where} lacks tensor {name}')
    self.used.add(name)
    x = np.asarray(self.tensors[name])
    if x.dtype == ml_dtypes.float8_e4m3fn:
      scale = f'{name}_scale_inv'
      if scale not in self.tensors:
        raise ConvertError(f'{self.where}: FP8 tensor {name} has no {scale}')
      self.used.add(scale)
      try:
        x = dequantize_fp8(x, np.asarray(self.tensors[scale]))
      except ValueError as e:
        raise ConvertError(f'{self.where}: {scale}: {e}') from e
    if shape and tuple(x.shape) != shape:
      raise ConvertError(f'{self.where}: tensor {name} has shape {tuple(x.shape)}, '
                         f'expected {shape}')
    return x.astype(np.float32)

  def unused(self) -> list[str]:
    return sorted(set(self.tensors) - self.used)


def _attn_from_hf(src: _Source, pre: str, args: ModelArgs, kind, zero_bias: bool) -> dict:
  d, n = args.d_model, args.n_heads
  if kind is layers.Attention:
    k, h = args.n_kv_heads, args.head_dim
    out = {'q_proj': {'kernel': src.get(f'{pre}.q_proj.weight', n * h, d).T.reshape(d, n, h)},
           'k_proj': {'kernel': src.get(f'{pre}.k_proj.weight', k * h, d).T.reshape(d, k, h)},
           'v_proj': {'kernel': src.get(f'{pre}.v_proj.weight', k * h, d).T.reshape(d, k, h)},
           'o_proj': {'kernel': src.get(f'{pre}.o_proj.weight', d, n * h).T.reshape(n, h, d)}}
    if zero_bias:
      for name, heads in (('q', n), ('k', k), ('v', k)):
        b = src.get(f'{pre}.{name}_proj.bias', heads * h)
        if args.attention_bias:
          out[f'{name}_proj']['bias'] = b.reshape(heads, h)
        elif np.any(b):
          raise ConvertError(f'{src.where}: {pre}.{name}_proj.bias is not zero but config.json '
                             'has no attention_bias=true (a model without q/k/v biases)')
    return out
  qr, kvr = args.q_lora_rank, args.kv_lora_rank
  dn, dr, dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
  out = {}
  if qr:
    out['q_a_proj'] = {'kernel': src.get(f'{pre}.q_a_proj.weight', qr, d).T}
    out['q_a_layernorm'] = {'scale': src.get(f'{pre}.q_a_layernorm.weight', qr)}
    qb = src.get(f'{pre}.q_b_proj.weight', n * (dn + dr), qr).T.reshape(qr, n, dn + dr)
    out['q_b_proj'] = {'kernel': rope_to_half(qb, dn)}
  else:
    q = src.get(f'{pre}.q_proj.weight', n * (dn + dr), d).T.reshape(d, n, dn + dr)
    out['q_proj'] = {'kernel': rope_to_half(q, dn)}
  kva = src.get(f'{pre}.kv_a_proj_with_mqa.weight', kvr + dr, d).T
  out['kv_a_proj_with_mqa'] = {'kernel': rope_to_half(kva, kvr)}
  out['kv_a_layernorm'] = {'scale': src.get(f'{pre}.kv_a_layernorm.weight', kvr)}
  out['kv_b_proj'] = {'kernel': src.get(f'{pre}.kv_b_proj.weight', n * (dn + dv), kvr).T
                      .reshape(kvr, n, dn + dv)}
  out['o_proj'] = {'kernel': src.get(f'{pre}.o_proj.weight', d, n * dv).T.reshape(n, dv, d)}
  return out


def _swiglu_from_hf(src: _Source, pre: str, d: int, f: int) -> dict:
  return {'gate_proj': {'kernel': src.get(f'{pre}.gate_proj.weight', f, d).T},
          'up_proj': {'kernel': src.get(f'{pre}.up_proj.weight', f, d).T},
          'down_proj': {'kernel': src.get(f'{pre}.down_proj.weight', d, f).T}}


def _mlp_from_hf(src: _Source, pre: str, args: ModelArgs, kind) -> dict:
  d = args.d_model
  if kind is layers.MLP:
    return _swiglu_from_hf(src, pre, d, args.mlp_dim)
  e, f = args.n_routed_experts, args.moe_intermediate_size
  experts = [_swiglu_from_hf(src, f'{pre}.experts.{j}', d, f) for j in range(e)]
  out = {'gate': {'kernel': src.get(f'{pre}.gate.weight', e, d).T,
                  'e_score_correction_bias': src.get(f'{pre}.gate.e_score_correction_bias', e)},
         'experts': {p: np.stack([x[p]['kernel'] for x in experts])
                     for p in ('gate_proj', 'up_proj', 'down_proj')}}
  if args.n_shared_experts:
    out['shared_experts'] = _swiglu_from_hf(src, f'{pre}.shared_experts', d,
                                            f * args.n_shared_experts)
  return out


def _block_from_hf(src: _Source, prefix: str, args: ModelArgs, layer: int,
                   zero_bias: bool) -> dict:
  attn_cls, mlp_cls = block_classes(args, layer)
  d = args.d_model
  return {'input_layernorm': {'scale': src.get(f'{prefix}.input_layernorm.weight', d)},
          'post_attention_layernorm': {
              'scale': src.get(f'{prefix}.post_attention_layernorm.weight', d)},
          'self_attn': _attn_from_hf(src, f'{prefix}.self_attn', args, attn_cls, zero_bias),
          'mlp': _mlp_from_hf(src, f'{prefix}.mlp', args, mlp_cls)}


# -- the whole model ----------------------------------------------------------------------
def check_layout(args: ModelArgs, layout: str) -> None:
  """ConvertError unless `layout` can hold this model (one line naming the field)."""
  if layout not in LAYOUTS:
    raise ConvertError(f'--layout must be one of {LAYOUTS}, got {layout!r}')
  if args.mtp_depth and args.mtp_kind != 'sequential':
    raise ConvertError(f'the {layout} layout holds sequential MTP modules only, not '
                       f'model.mtp.kind={args.mtp_kind!r}')
  if args.rope_scaling:
    raise ConvertError(f'the {layout} layout is written with unscaled RoPE; this model has '
                       f'model.rope_scaling {args.rope_scaling[0]!r} (not exported yet)')
  kinds = [block_classes(args, i) for i in range(args.n_layers + (args.mtp_depth > 0))]
  if layout == 'deepseek_v3':
    if any(a is not mla.MLAttention for a, _ in kinds):
      raise ConvertError('the deepseek_v3 layout needs MLA attention in every block '
                         '(model.attention=mla, model.mtp.block_attention unset or mla); a '
                         'GQA model exports as --layout mimo')
    mtp_mlp = kinds[-1][1] if args.mtp_depth else None
    rule = layers.MLP if args.mlp == 'dense' or args.n_layers < args.first_k_dense else moe.MoE
    if mtp_mlp is not None and mtp_mlp is not rule:
      raise ConvertError('the deepseek_v3 layout gives the MTP block the MLP kind of layer '
                         'num_hidden_layers (first_k_dense_replace rule); '
                         'model.mtp.block_mlp differs from it')
  elif any(a is not layers.Attention or m is not layers.MLP for a, m in kinds):
    raise ConvertError('the mimo layout holds a dense GQA (Qwen2-style) model; MLA / MoE '
                       'blocks export as --layout deepseek_v3')


def _mtp_prefix(layout: str, args: ModelArgs, k: int) -> str:
  """Name prefix of MTP depth k (1-based)."""
  if layout == 'deepseek_v3':
    return f'model.layers.{args.n_layers + k - 1}'
  return f'model.mtp_layers.{k - 1}'


def to_hf(params: dict, args: ModelArgs, layout: str = 'deepseek_v3') -> dict:
  """Pure dict of the model's Params + routing biases -> {hf_name: numpy array}."""
  check_layout(args, layout)
  mimo = layout == 'mimo'
  embed = np.asarray(params['embed']['embedding'])
  head = embed if args.tie_embeddings else _t(params['lm_head']['kernel'])
  # lm_head.weight even when tied: vLLM's MiMo MTP loads its own ParallelLMHead from it (and
  # DeepSeek's layout has no tying); tying loaders (transformers, SGLang) skip or tie it.
  out = {'model.embed_tokens.weight': embed,
         'model.norm.weight': np.asarray(params['norm']['scale']),
         'lm_head.weight': head}
  for i in range(args.n_layers):
    out.update(_block_to_hf(params['layers'][i], f'model.layers.{i}', args, i, mimo))
  d = args.d_model
  for k in range(1, args.mtp_depth + 1):
    p, pre = params['mtp'][k - 1], _mtp_prefix(layout, args, k)
    eh_DxE = _t(p['eh_proj']['kernel'])  # [d, 2d]; columns :d act on the embedding
    if mimo:
      out[f'{pre}.token_layernorm.weight'] = np.asarray(p['enorm']['scale'])
      out[f'{pre}.hidden_layernorm.weight'] = np.asarray(p['hnorm']['scale'])
      out[f'{pre}.input_proj.weight'] = np.ascontiguousarray(
          np.concatenate([eh_DxE[:, d:], eh_DxE[:, :d]], axis=1))  # on [h ; emb]
      out[f'{pre}.final_layernorm.weight'] = np.asarray(p['shared_head']['norm']['scale'])
    else:
      out[f'{pre}.enorm.weight'] = np.asarray(p['enorm']['scale'])
      out[f'{pre}.hnorm.weight'] = np.asarray(p['hnorm']['scale'])
      out[f'{pre}.eh_proj.weight'] = eh_DxE
      out[f'{pre}.shared_head.norm.weight'] = np.asarray(p['shared_head']['norm']['scale'])
      out[f'{pre}.embed_tokens.weight'] = embed
      out[f'{pre}.shared_head.head.weight'] = head
    out.update(_block_to_hf(p['block'], pre, args, args.n_layers, mimo))
  return out


def from_hf(tensors, args: ModelArgs, layout: str = 'deepseek_v3', where: str = 'checkpoint',
            ) -> dict:
  """{hf_name: array} (or a Checkpoint) -> a pure dict for nnx.replace_by_pure_dict.

  Every tensor must be used; FP8 weights are dequantised with their weight_scale_inv;
  copies of the shared embedding / head must equal it (this project shares them).
  """
  check_layout(args, layout)
  mimo = layout == 'mimo'
  src = _Source(tensors, where)
  d, v = args.d_model, args.vocab_size
  embed = src.get('model.embed_tokens.weight', v, d)
  params = {'embed': {'embedding': embed},
            'norm': {'scale': src.get('model.norm.weight', d)},
            'layers': {i: _block_from_hf(src, f'model.layers.{i}', args, i, mimo)
                       for i in range(args.n_layers)}}
  if 'lm_head.weight' in src or not args.tie_embeddings:  # tied checkpoints may omit it
    head = src.get('lm_head.weight', v, d)
  else:
    head = embed
  if args.tie_embeddings:
    if not np.array_equal(head, embed):
      raise ConvertError(f'{where}: lm_head.weight differs from model.embed_tokens.weight '
                         'but the model ties them (tie_word_embeddings)')
  else:
    params['lm_head'] = {'kernel': head.T}
  mtp = {}
  for k in range(1, args.mtp_depth + 1):
    pre = _mtp_prefix(layout, args, k)
    if not any(name.startswith(f'{pre}.') for name in src.tensors):
      raise ConvertError(f'{where}: num_nextn_predict_layers={args.mtp_depth} but no tensor '
                         f'of MTP depth {k} ({pre}.*); transformers\' save_pretrained drops '
                         'MTP layers')
    if mimo:
      names = ('token_layernorm', 'hidden_layernorm', 'input_proj', 'final_layernorm')
    else:
      names = ('enorm', 'hnorm', 'eh_proj', 'shared_head.norm')
      for name, shared in (('embed_tokens', embed), ('shared_head.head', head)):
        full = f'{pre}.{name}.weight'
        if full in src and not np.array_equal(src.get(full, v, d), shared):
          raise ConvertError(f'{where}: {full} differs from the shared tensor; this '
                             'project shares Emb and OutHead across depths')
    enorm, hnorm, proj, final = names
    eh_DxE = src.get(f'{pre}.{proj}.weight', d, 2 * d)
    if mimo:  # input_proj acts on [h ; emb]
      eh_DxE = np.concatenate([eh_DxE[:, d:], eh_DxE[:, :d]], axis=1)
    mtp[k - 1] = {'enorm': {'scale': src.get(f'{pre}.{enorm}.weight', d)},
                  'hnorm': {'scale': src.get(f'{pre}.{hnorm}.weight', d)},
                  'eh_proj': {'kernel': eh_DxE.T},
                  'shared_head': {'norm': {'scale': src.get(f'{pre}.{final}.weight', d)}},
                  'block': _block_from_hf(src, pre, args, args.n_layers, mimo)}
  params['mtp'] = mtp
  left = src.unused()
  if left:
    raise ConvertError(f'{where}: {len(left)} tensor(s) not part of this model, e.g. '
                       f'{left[:4]}')
  return params


def model_params(model: MTPModel) -> dict:
  """The numpy pure dict of a model's Params and aux-loss-free routing biases."""
  state = nnx.state(model, (nnx.Param, moe.RoutingBias))
  return _numpy(nnx.to_pure_dict(state))


def load_params(model: MTPModel, params: dict) -> None:
  """Puts a pure dict (from_hf's) into the model, dtypes and shapes checked by NNX."""
  state = nnx.state(model, (nnx.Param, moe.RoutingBias))
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)


def _numpy(tree):
  if isinstance(tree, dict):
    return {k: _numpy(v) for k, v in tree.items()}
  return np.asarray(tree)


# -- config.json --------------------------------------------------------------------------
def hf_config(args: ModelArgs, layout: str, dtype: str = 'float32', fp8: bool = False,
              max_positions: int = 4096) -> dict:
  """config.json of an exported model: DeepSeek-V3's fields, or MiMo's (Qwen2's + MTP)."""
  check_layout(args, layout)
  c = {'vocab_size': args.vocab_size, 'hidden_size': args.d_model,
       'intermediate_size': args.mlp_dim, 'num_hidden_layers': args.n_layers,
       'num_attention_heads': args.n_heads, 'rms_norm_eps': args.norm_eps,
       'rope_theta': args.rope_theta, 'rope_scaling': None,
       'tie_word_embeddings': args.tie_embeddings, 'hidden_act': 'silu',
       'max_position_embeddings': max_positions, 'num_nextn_predict_layers': args.mtp_depth,
       'torch_dtype': dtype, 'attention_dropout': 0.0, 'initializer_range': args.init_std,
       'use_cache': True}
  if layout == 'mimo':
    # Qwen2 always carries q/k/v biases; attention_bias says they are real (not zeros) to
    # this converter's import (Qwen2 loaders ignore the field).
    c['attention_bias'] = bool(args.attention_bias)
    c.update(architectures=['MiMoForCausalLM'], model_type='mimo',
             num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim,
             use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    return c
  moe_layers = args.mlp == 'moe'
  c.update(architectures=['DeepseekV3ForCausalLM'], model_type='deepseek_v3',
           num_key_value_heads=args.n_heads, q_lora_rank=args.q_lora_rank or None,
           kv_lora_rank=args.kv_lora_rank, qk_nope_head_dim=args.qk_nope_head_dim,
           qk_rope_head_dim=args.qk_rope_head_dim, v_head_dim=args.v_head_dim,
           rope_interleave=True, attention_bias=False,
           # dense everywhere: no layer (MTP's included) reaches first_k_dense_replace
           first_k_dense_replace=(args.first_k_dense if moe_layers
                                  else args.n_layers + max(args.mtp_depth, 1)),
           moe_layer_freq=1, n_routed_experts=args.n_routed_experts,
           n_shared_experts=args.n_shared_experts, num_experts_per_tok=args.num_experts_per_tok,
           moe_intermediate_size=args.moe_intermediate_size,
           routed_scaling_factor=args.routed_scaling_factor, scoring_func='sigmoid',
           topk_method='noaux_tc', norm_topk_prob=True, n_group=args.n_group,
           topk_group=args.topk_group)
  if fp8:
    c['quantization_config'] = {'activation_scheme': 'dynamic', 'fmt': 'e4m3',
                                'quant_method': 'fp8', 'weight_block_size': [FP8_BLOCK] * 2}
  return c


def _field(cfg: dict, name: str, where: str, default=...):
  if name in cfg and cfg[name] is not None:
    return cfg[name]
  if default is ...:
    raise ConvertError(f'{where}: config.json lacks {name!r}')
  return default


def _rope_theta(cfg: dict, where: str) -> float:
  """rope_theta, refusing RoPE scaling (YaRN etc.): this project's RoPE has none."""
  params = cfg.get('rope_parameters') or {}
  scaling = cfg.get('rope_scaling') or {}
  for extra in (params, scaling):
    kind = extra.get('rope_type', extra.get('type', 'default'))
    if kind not in ('default', None):
      raise ConvertError(f'{where}: config.json rope scaling {kind!r} is not supported '
                         "(this project's RoPE is unscaled)")
  theta = cfg.get('rope_theta', params.get('rope_theta'))
  if theta is None:
    raise ConvertError(f"{where}: config.json lacks 'rope_theta'")
  return float(theta)


def layout_of(cfg: dict, where: str = 'checkpoint') -> str:
  """The layout of a config.json: its model_type."""
  kind = cfg.get('model_type')
  if kind == 'deepseek_v3':
    return 'deepseek_v3'
  if kind == 'mimo':
    return 'mimo'
  raise ConvertError(f'{where}: config.json model_type {kind!r} is not a layout this '
                     "converter reads ('deepseek_v3', 'mimo'; Llama / Qwen2 trunks load "
                     'through --init_from hf:DIR)')


def config_from_hf(cfg: dict, where: str = 'checkpoint', base=None):
  """A config (base_config() or `base`) whose model is the one config.json describes."""
  layout = layout_of(cfg, where)
  c = config_lib.base_config() if base is None else base
  m = c.model
  m.vocab_size = int(_field(cfg, 'vocab_size', where))
  m.d_model = int(_field(cfg, 'hidden_size', where))
  m.n_layers = int(_field(cfg, 'num_hidden_layers', where))
  m.n_heads = int(_field(cfg, 'num_attention_heads', where))
  m.mlp_dim = int(_field(cfg, 'intermediate_size', where))
  m.norm_eps = float(_field(cfg, 'rms_norm_eps', where))
  m.rope_theta = _rope_theta(cfg, where)
  m.tie_embeddings = bool(_field(cfg, 'tie_word_embeddings', where, False))
  m.mtp.depth = int(_field(cfg, 'num_nextn_predict_layers', where, 0))
  m.mtp.kind = 'sequential'
  act = _field(cfg, 'hidden_act', where, 'silu')
  if act != 'silu':
    raise ConvertError(f'{where}: config.json hidden_act {act!r}: only silu (SwiGLU) is built')
  if layout == 'mimo':
    m.attention, m.mlp = 'gqa', 'dense'
    m.attention_bias = bool(_field(cfg, 'attention_bias', where, False))
    m.n_kv_heads = int(_field(cfg, 'num_key_value_heads', where, m.n_heads))
    m.head_dim = int(_field(cfg, 'head_dim', where, m.d_model // m.n_heads))
    return c
  if _field(cfg, 'attention_bias', where, False):
    raise ConvertError(f'{where}: config.json attention_bias=true: MLA here has no biases')
  m.attention = 'mla'
  m.mla.q_lora_rank = int(_field(cfg, 'q_lora_rank', where, 0))
  for name in ('kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim'):
    m.mla[name] = int(_field(cfg, name, where))
  e = int(_field(cfg, 'n_routed_experts', where, 0))
  first = int(_field(cfg, 'first_k_dense_replace', where, 0))
  if not e or first >= m.n_layers + max(m.mtp.depth, 1):
    m.mlp = 'dense'
    return c
  checks = (('scoring_func', 'sigmoid'), ('topk_method', 'noaux_tc'), ('norm_topk_prob', True),
            ('moe_layer_freq', 1))
  for name, want in checks:
    got = _field(cfg, name, where, want)
    if got != want:
      raise ConvertError(f'{where}: config.json {name}={got!r}: only {want!r} is implemented')
  m.mlp = 'moe'
  m.moe.n_routed_experts = e
  m.moe.first_k_dense = first
  m.moe.n_shared_experts = int(_field(cfg, 'n_shared_experts', where, 0))
  m.moe.num_experts_per_tok = int(_field(cfg, 'num_experts_per_tok', where))
  m.moe.moe_intermediate_size = int(_field(cfg, 'moe_intermediate_size', where))
  m.moe.routed_scaling_factor = float(_field(cfg, 'routed_scaling_factor', where, 1.0))
  # Node-limited routing (moe.route): DeepSeek-V3's own is n_group 8, topk_group 4.
  m.moe.n_group = int(_field(cfg, 'n_group', where, 1))
  m.moe.topk_group = int(_field(cfg, 'topk_group', where, m.moe.n_group))
  if m.moe.topk_group == m.moe.n_group:  # every group allowed: plain top-k
    m.moe.n_group = m.moe.topk_group = 1
  return c


# -- safetensors directories --------------------------------------------------------------
INDEX = 'model.safetensors.index.json'


class Checkpoint:
  """A local Hugging Face-layout directory, read tensor by tensor (a Mapping of names).

  config.json plus model.safetensors, or shards listed by model.safetensors.index.json.
  FP8 (F8_E4M3) tensors are read from the file's bytes (safetensors' numpy loader has no
  float8 dtype as of 0.8.0); everything else through safetensors.safe_open.
  """

  def __init__(self, directory: str):
    self.where = directory
    if not os.path.isdir(directory):
      raise ConvertError(f'{directory!r} is not a directory (a local Hugging Face-layout '
                         'checkpoint: config.json + *.safetensors)')
    path = os.path.join(directory, 'config.json')
    if not os.path.isfile(path):
      raise ConvertError(f'{directory!r} has no config.json')
    try:
      with open(path) as f:
        self.config = json.load(f)
    except ValueError as e:
      raise ConvertError(f'{path}: not valid JSON ({e})') from e
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
      with open(index) as f:
        weight_map = json.load(f).get('weight_map', {})
    elif os.path.isfile(os.path.join(directory, 'model.safetensors')):
      weight_map = None
    else:
      raise ConvertError(f'{directory!r} has neither model.safetensors nor {INDEX}')
    self._file, self._info = {}, {}
    files = sorted(set(weight_map.values())) if weight_map else ['model.safetensors']
    for name in files:
      full = os.path.join(directory, name)
      if not os.path.isfile(full):
        raise ConvertError(f'{directory!r}: {INDEX} names {name}, which is missing')
      for key, info in _header(full).items():
        if key != '__metadata__':
          self._file[key], self._info[key] = full, info
    if weight_map:
      missing = sorted(k for k in weight_map if k not in self._file)
      if missing:
        raise ConvertError(f'{directory!r}: {INDEX} lists {missing[0]}, which its file lacks')

  def __contains__(self, name) -> bool:
    return name in self._file

  def __iter__(self):
    return iter(self._file)

  def __len__(self) -> int:
    return len(self._file)

  def keys(self):
    return self._file.keys()

  def dtype(self, name: str) -> str:
    """The safetensors dtype string (F32, BF16, F8_E4M3, ...)."""
    return self._info[name]['dtype']

  def __getitem__(self, name: str) -> np.ndarray:
    info, path = self._info[name], self._file[name]
    if info['dtype'] == 'F8_E4M3':
      start, end = info['data_offsets']
      with open(path, 'rb') as f:
        n = int.from_bytes(f.read(8), 'little')
        f.seek(8 + n + start)
        raw = f.read(end - start)
      return np.frombuffer(raw, ml_dtypes.float8_e4m3fn).reshape(info['shape'])
    with safe_open(path, 'numpy') as f:
      return f.get_tensor(name)


def _header(path: str) -> dict:
  """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
  try:
    with open(path, 'rb') as f:
      n = int.from_bytes(f.read(8), 'little')
      if n <= 0 or n > os.path.getsize(path):
        raise ValueError('bad header length')
      return json.loads(f.read(n))
  except ValueError as e:
    raise ConvertError(f'{path}: not a safetensors file ({e})') from e


def write_dir(directory: str, tensors: dict, config: dict,
              shard_bytes: int = SHARD_BYTES) -> list[str]:
  """config.json + model.safetensors, or shards + model.safetensors.index.json when the
  tensors exceed shard_bytes. Returns the file names written."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(config, f, indent=2, sort_keys=True)
  shards, size = [[]], 0
  for name in tensors:  # insertion order: layer by layer
    nbytes = tensors[name].nbytes
    if shards[-1] and size + nbytes > shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  meta = {'format': 'pt'}  # what transformers / vLLM check for
  if len(shards) == 1:
    save_file({k: np.ascontiguousarray(tensors[k]) for k in shards[0]},
              os.path.join(directory, 'model.safetensors'), metadata=meta)
    return ['config.json', 'model.safetensors']
  names = [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))]
  weight_map = {}
  for file, keys in zip(names, shards):
    save_file({k: np.ascontiguousarray(tensors[k]) for k in keys},
              os.path.join(directory, file), metadata=meta)
    weight_map.update({k: file for k in keys})
  total = sum(t.nbytes for t in tensors.values())
  with open(os.path.join(directory, INDEX), 'w') as f:
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  return ['config.json', INDEX] + names


# -- export / import ----------------------------------------------------------------------
def export_model(model: MTPModel, directory: str, layout: str, *, fp8: bool = False,
                 shard_bytes: int = SHARD_BYTES) -> dict:
  """Writes the model as a HF-layout directory; returns the tensors written (by name).

  fp8 (deepseek_v3 only): the tensors DeepSeek-V3's release stores as FP8 are quantised in
  128 x 128 blocks with a weight_scale_inv each (lossy); otherwise every tensor is float32
  as trained, and reading it back is bit-exact.
  """
  args = model.args
  if fp8 and layout != 'deepseek_v3':
    raise ConvertError('--fp8 is the deepseek_v3 layout\'s weight format; mimo has none')
  tensors = to_hf(model_params(model), args, layout)
  if fp8:
    quantised = {}
    for name, x in tensors.items():
      if _fp8_in_release(name):
        quantised[name], quantised[f'{name}_scale_inv'] = quantize_fp8(x)
      else:
        quantised[name] = x
    tensors = quantised
  write_dir(directory, tensors, hf_config(args, layout, fp8=fp8), shard_bytes)
  return tensors


def load_dir(directory: str, base=None) -> tuple:
  """(config, model) of a HF-layout directory in one of LAYOUTS; ConvertError on bad input
  (a missing tensor, a wrong shape, an unsupported config field), before compiling."""
  ckpt = Checkpoint(directory)
  config = config_from_hf(ckpt.config, directory, base)
  config_lib.validate(config)  # a config.json value out of range: one ConfigError line
  args = ModelArgs.from_config(config)
  params = from_hf(ckpt, args, layout_of(ckpt.config, directory), where=directory)
  model = MTPModel(args, rngs=nnx.Rngs(0))
  load_params(model, params)
  return config, model


def export_workdir(workdir: str, directory: str, layout: str, *, step: int | None = None,
                   fp8: bool = False, shard_bytes: int = SHARD_BYTES) -> dict:
  """A training workdir's checkpoint (default: newest) exported as export_model does.

  Checks the layout against the saved config before restoring anything. Returns a summary.
  """
  if layout not in LAYOUTS:
    raise ConvertError(f'--layout must be one of {LAYOUTS}, got {layout!r}')
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise ConvertError(f'--out {directory!r} exists and is not an empty directory')
  config, step = ckpt_lib.load_workdir(workdir, step)
  args = ModelArgs.from_config(config)
  check_layout(args, layout)
  if fp8 and layout != 'deepseek_v3':
    raise ConvertError('--fp8 is the deepseek_v3 layout\'s weight format; mimo has none')
  model = state_lib.restore_model(config, workdir, step)
  tensors = export_model(model, directory, layout, fp8=fp8, shard_bytes=shard_bytes)
  return {'step': step, 'layout': layout, 'out': directory, 'tensors': len(tensors),
          'bytes': int(sum(t.nbytes for t in tensors.values())),
          'mtp_depth': args.mtp_depth, 'fp8': fp8,
          'params': int(sum(math.prod(t.shape) for n, t in tensors.items()
                            if not n.endswith('_scale_inv')))}
