"""This project's parameters <-> Hugging Face DeepSeek-V3 tensor names (torch layout).

DeepSeek-V3 stores MTP depth k as decoder layer `n_layers + k - 1`, with `enorm`,
`hnorm`, `eh_proj` (acting on [emb ; hidden]), the block's usual names and
`shared_head.norm`; the release also repeats the shared `embed_tokens` and
`shared_head.head` inside each MTP layer, which `to_hf(..., with_shared_copies=True)`
writes and `from_hf` checks against the shared tensors. Attention and MLP use the
Llama/DeepSeek dense names (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`):
this project's blocks are GQA + dense SwiGLU, not MLA + MoE, so those tensors map
one-to-one only onto models of the same block type.
Torch `Linear.weight` is [out, in]; Flax kernels are [in, out] (heads split out).
"""
from __future__ import annotations

import numpy as np

from mtp_jax.model import ModelArgs, uses_latent_or_experts

FP8_BLOCK = 128  # DeepSeek-V3's weight quantisation blocks: 128 x 128 per weight_scale_inv entry


def dequantize_fp8(weight_OxI: np.ndarray, scale_inv_PxQ: np.ndarray,
                   block: int = FP8_BLOCK) -> np.ndarray:
  """float32 weight of a DeepSeek-V3 FP8 (e4m3) tensor and its `weight_scale_inv`.

  Entry [p, q] of scale_inv multiplies block rows p*block.., columns q*block.. (the last
  blocks may be partial: scale_inv is [ceil(O / block), ceil(I / block)]), as DeepSeek's
  own `weight_dequant`. Not yet wired into from_hf (which has no MLA / MoE names).
  """
  o, i = weight_OxI.shape
  want = (-(-o // block), -(-i // block))
  if scale_inv_PxQ.shape != want:
    raise ValueError(f'weight_scale_inv has shape {scale_inv_PxQ.shape}, expected {want} '
                     f'for a {weight_OxI.shape} weight in {block} x {block} blocks')
  scale = np.repeat(np.repeat(scale_inv_PxQ.astype(np.float32), block, 0), block, 1)
  return weight_OxI.astype(np.float32) * scale[:o, :i]


def _check_dense_gqa(args: ModelArgs) -> None:
  if uses_latent_or_experts(args):
    raise ValueError('convert maps GQA + dense-MLP blocks only; MLA / MoE names are not '
                     'implemented yet (issue 13)')


def _block_to_hf(p: dict, prefix: str, args: ModelArgs) -> dict:
  a, m = p['self_attn'], p['mlp']
  d = args.d_model
  return {
      f'{prefix}.input_layernorm.weight': p['input_layernorm']['scale'],
      f'{prefix}.post_attention_layernorm.weight': p['post_attention_layernorm']['scale'],
      f'{prefix}.self_attn.q_proj.weight': a['q_proj']['kernel'].reshape(d, -1).T,
      f'{prefix}.self_attn.k_proj.weight': a['k_proj']['kernel'].reshape(d, -1).T,
      f'{prefix}.self_attn.v_proj.weight': a['v_proj']['kernel'].reshape(d, -1).T,
      f'{prefix}.self_attn.o_proj.weight': a['o_proj']['kernel'].reshape(-1, d).T,
      f'{prefix}.mlp.gate_proj.weight': m['gate_proj']['kernel'].T,
      f'{prefix}.mlp.up_proj.weight': m['up_proj']['kernel'].T,
      f'{prefix}.mlp.down_proj.weight': m['down_proj']['kernel'].T,
  }


def _block_from_hf(t: dict, prefix: str, args: ModelArgs) -> dict:
  d, n, k, h = args.d_model, args.n_heads, args.n_kv_heads, args.head_dim

  def w(name):
    return np.asarray(t.pop(f'{prefix}.{name}.weight'))

  return {
      'input_layernorm': {'scale': w('input_layernorm')},
      'post_attention_layernorm': {'scale': w('post_attention_layernorm')},
      'self_attn': {
          'q_proj': {'kernel': w('self_attn.q_proj').T.reshape(d, n, h)},
          'k_proj': {'kernel': w('self_attn.k_proj').T.reshape(d, k, h)},
          'v_proj': {'kernel': w('self_attn.v_proj').T.reshape(d, k, h)},
          'o_proj': {'kernel': w('self_attn.o_proj').T.reshape(n, h, d)},
      },
      'mlp': {
          'gate_proj': {'kernel': w('mlp.gate_proj').T},
          'up_proj': {'kernel': w('mlp.up_proj').T},
          'down_proj': {'kernel': w('mlp.down_proj').T},
      },
  }


def output_weight(params: dict, args: ModelArgs) -> np.ndarray:
  """OutHead in torch layout [V, d]."""
  if args.tie_embeddings:
    return np.asarray(params['embed']['embedding'])
  return np.asarray(params['lm_head']['kernel']).T


def to_hf(params: dict, args: ModelArgs, *, with_shared_copies: bool = True) -> dict:
  """nnx.to_pure_dict(params) -> {hf_name: numpy array}."""
  _check_dense_gqa(args)
  params = _numpy(params)
  out = {'model.embed_tokens.weight': params['embed']['embedding'],
         'model.norm.weight': params['norm']['scale'],
         'lm_head.weight': output_weight(params, args)}
  for i in range(args.n_layers):
    out.update(_block_to_hf(params['layers'][i], f'model.layers.{i}', args))
  if args.mtp_depth and args.mtp_kind != 'sequential':
    raise ValueError('the DeepSeek-V3 layout holds sequential MTP modules only, '
                     f'not model.mtp.kind={args.mtp_kind!r}')
  for k in range(args.mtp_depth):
    p = params['mtp'][k]
    prefix = f'model.layers.{args.n_layers + k}'
    out[f'{prefix}.enorm.weight'] = p['enorm']['scale']
    out[f'{prefix}.hnorm.weight'] = p['hnorm']['scale']
    out[f'{prefix}.eh_proj.weight'] = p['eh_proj']['kernel'].T  # [d, 2d] on [emb ; h]
    out[f'{prefix}.shared_head.norm.weight'] = p['shared_head']['norm']['scale']
    out.update(_block_to_hf(p['block'], prefix, args))
    if with_shared_copies:
      out[f'{prefix}.embed_tokens.weight'] = out['model.embed_tokens.weight']
      out[f'{prefix}.shared_head.head.weight'] = out['lm_head.weight']
  return out


def from_hf(tensors: dict, args: ModelArgs) -> dict:
  """{hf_name: array} -> a pure dict for nnx.replace_by_pure_dict; every tensor is used."""
  _check_dense_gqa(args)
  t = dict(tensors)
  embed = np.asarray(t.pop('model.embed_tokens.weight'))
  head = np.asarray(t.pop('lm_head.weight'))
  params = {'embed': {'embedding': embed},
            'norm': {'scale': np.asarray(t.pop('model.norm.weight'))},
            'layers': {i: _block_from_hf(t, f'model.layers.{i}', args) for i in range(args.n_layers)}}
  if args.tie_embeddings:
    if not np.array_equal(head, embed):
      raise ValueError('lm_head.weight differs from model.embed_tokens.weight but the model '
                       'ties them (model.tie_embeddings=True)')
  else:
    params['lm_head'] = {'kernel': head.T}
  mtp = {}
  for k in range(args.mtp_depth):
    prefix = f'model.layers.{args.n_layers + k}'
    for name, shared in (('embed_tokens', embed), ('shared_head.head', head)):
      copy = t.pop(f'{prefix}.{name}.weight', None)
      if copy is not None and not np.array_equal(np.asarray(copy), shared):
        raise ValueError(f'{prefix}.{name}.weight differs from the shared tensor; this '
                         'project shares Emb and OutHead across depths')
    mtp[k] = {'enorm': {'scale': np.asarray(t.pop(f'{prefix}.enorm.weight'))},
              'hnorm': {'scale': np.asarray(t.pop(f'{prefix}.hnorm.weight'))},
              'eh_proj': {'kernel': np.asarray(t.pop(f'{prefix}.eh_proj.weight')).T},
              'shared_head': {'norm': {'scale': np.asarray(t.pop(f'{prefix}.shared_head.norm.weight'))}},
              'block': _block_from_hf(t, prefix, args)}
  params['mtp'] = mtp
  if t:
    raise ValueError(f'unused tensors (not part of this model): {sorted(t)[:8]}')
  return params


def _numpy(tree):
  if isinstance(tree, dict):
    return {k: _numpy(v) for k, v in tree.items()}
  return np.asarray(tree)
