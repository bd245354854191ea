"""Tensor name tables: each parameter of the model and the Hugging Face tensor it is stored as.

One table per layout, read in both directions (export writes it, import reads it):

llama  Hugging Face's Llama names, which Mistral and Qwen2 share: model.embed_tokens,
  model.layers.{i}.input_layernorm, self_attn.{q,k,v,o}_proj (+ q/k/v .bias in Qwen2),
  post_attention_layernorm, mlp.{gate,up,down}_proj, model.norm, lm_head. The trunk only.
deepseek_v3  DeepSeek-V3's release (README_WEIGHTS.md of github.com/deepseek-ai/DeepSeek-V3):
  MLA (`self_attn.q_a_proj / q_a_layernorm / q_b_proj`, or `q_proj` when q_lora_rank is None,
  `kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj`), a dense SwiGLU in the first
  `first_k_dense_replace` layers, DeepSeekMoE after (`mlp.gate.weight`,
  `mlp.gate.e_score_correction_bias`, `mlp.experts.{j}.*`, `mlp.shared_experts.*`); MTP
  depth k at decoder layer `num_hidden_layers + k - 1` with `enorm`, `hnorm`, `eh_proj` (on
  [enorm(emb) ; hnorm(h)]), a block's names, `shared_head.norm`, and copies of the shared
  `embed_tokens` and `shared_head.head` (vLLM's deepseek_mtp.py loads them per MTP layer).
  FP8 (fp8.py) applies to the projection weights of every decoder layer.
mimo  Xiaomi MiMo's MTP layers on a Qwen2 trunk, as vLLM's and SGLang's mimo_mtp.py load
  them: depth k at `model.mtp_layers.{k-1}` with `token_layernorm` (= enorm),
  `hidden_layernorm` (= hnorm), `input_proj` on [hidden_layernorm(h) ; token_layernorm(emb)]
  (DeepSeek's order swapped: its column halves are swapped), a Qwen2 decoder layer's names
  directly under the prefix, and `final_layernorm` (= shared_head.norm). The q/k/v biases
  are the model's own (model.attention_bias) or zeros, which must be zeros on import.

RoPE: this project rotates in the rotate-half form (layers.apply_rope); DeepSeek's weights
keep each rotary pair (x_2i, x_2i+1) adjacent (its inference/model.py multiplies complex
numbers; transformers' DeepseekV3 calls that `rope_interleave`), so the rotary output rows
of q_b_proj / q_proj (per head) and of kv_a_proj_with_mqa are permuted on import and back on
export. Llama-family weights are rotate-half already. Torch `Linear.weight` is [out, in];
Flax kernels are [in, out] with heads split out.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import mtp_jax.interop.fp8 as fp8_lib
from mtp_jax.config import kinds
from mtp_jax.interop.safetensors_io import InteropError
from mtp_jax.model import layers
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.blocks import block_classes, block_kinds

LAYOUTS = ('llama', 'deepseek_v3', 'mimo')
IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)  # old checkpoints store RoPE buffers


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter and the Hugging Face tensor(s) holding it.

  kind: how the parameter P comes from the torch tensor W: 'copy' (P = W), 'T' (a torch
  Linear: P = W.T), 'in_heads' (q/k/v [heads*hd, d] -> [d, heads, hd]), 'out_heads'
  (o [d, heads*hd] -> [heads, hd, d]), 'bias_heads' ([heads*hd] -> [heads, hd]); 'zero' (no
  parameter: zeros on export, must be zeros on import); 'alias' (no parameter: a copy of
  tensor `of`, written on export, must equal it on import, may be absent).
  """
  name: str  # the Hugging Face name; with '{j}' for a stack of experts
  path: tuple | None  # the parameter's path in the model's nnx.State (no '.value' leaf)
  kind: str
  shape: tuple  # the Hugging Face (torch) shape, of one expert for a stack
  rope_start: int | None = None  # P's last axis holds interleaved rotary pairs from here
  experts: int = 0  # > 0: P is [experts, ...], expert j stored as name.format(j=j)
  swap_halves: bool = False  # W's column halves are swapped (MiMo's input_proj)
  fp8: bool = False  # DeepSeek-V3's release stores it as FP8 + weight_scale_inv
  of: str = ''  # alias: the tensor this one copies

  def names(self) -> list[str]:
    return [self.name.format(j=j) for j in range(self.experts)] if self.experts else [self.name]

  @property
  def sliceable(self) -> bool:
    """Whether a device's block of P can be read from the file without the whole tensor."""
    return not (self.rope_start is not None or self.experts or self.swap_halves)


# -- RoPE row order -----------------------------------------------------------------------
def _pairs_to_half(dr: int) -> np.ndarray:
  """Index p with half = pairs[..., p]: rotate-half slot j < dr/2 is pair element 2j,
  slot dr/2 + j is 2j + 1 (both rotate by frequency j)."""
  return np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])


def _permute_tail(x: np.ndarray, start: int, order: np.ndarray) -> np.ndarray:
  return x[..., np.concatenate([np.arange(start), start + order])]


def rope_to_half(x: np.ndarray, start: int) -> np.ndarray:
  """Interleaved rotary entries [start:] of the last axis -> this project's rotate-half."""
  return _permute_tail(x, start, _pairs_to_half(x.shape[-1] - start))


def rope_to_pairs(x: np.ndarray, start: int) -> np.ndarray:
  """The inverse of rope_to_half."""
  return _permute_tail(x, start, np.argsort(_pairs_to_half(x.shape[-1] - start)))


# -- the tables ---------------------------------------------------------------------------
def check_layout(args: ModelArgs, layout: str) -> None:
  """InteropError unless `layout` can hold this model (one line naming the field)."""
  if layout not in LAYOUTS:
    raise InteropError(f'--layout must be one of {", ".join(LAYOUTS)}, got {layout!r}')
  if layout != 'llama' and args.mtp_depth and not args.mtp_head().hf_layer:
    raise InteropError(f'the {layout} layout holds sequential MTP modules only, not '
                       f'model.mtp.kind={args.mtp_kind!r} (--layout llama writes the trunk)')
  if layout != 'llama' and args.mtp_depth and args.drafting_depths() < args.mtp_depth:
    raise InteropError(f'the {layout} layout\'s MTP layers predict the adjacent tokens; this '
                       f'model has leap targets model.mtp.target_offsets '
                       f'{args.mtp_target_offsets} (--layout llama writes the trunk)')
  if layout != 'llama' and args.mtp_depth and args.share_modules:
    raise InteropError(f'the {layout} layout holds one MTP layer per depth; this model shares '
                       'one module across its depths (model.mtp.share_modules; --layout llama '
                       'writes the trunk)')
  blocks = [block_kinds(args, i) for i in range(args.n_layers + (args.mtp_depth > 0))]
  if layout == 'llama':
    blocks = blocks[:args.n_layers]
  if layout == 'deepseek_v3' and args.rope_scaling:
    raise InteropError(f'the deepseek_v3 layout is written with unscaled RoPE; this model '
                       f'has model.rope_scaling {args.rope_scaling[0]!r}')
  for attention, mlp in dict.fromkeys(blocks):
    _check_kind(layout, 'attention', attention, kinds.ATTENTION)
    _check_kind(layout, 'MLP', mlp, kinds.MLP)
  if layout == 'deepseek_v3' and args.mtp_depth:
    rule = 'dense' if args.mlp == 'dense' or args.n_layers < args.first_k_dense else 'moe'
    if blocks[-1][1] != rule:
      raise InteropError('the deepseek_v3 layout gives the MTP block the MLP kind of layer '
                         'num_hidden_layers (first_k_dense_replace rule); '
                         'model.mtp.block_mlp differs from it')


# What each layout holds, as its refusals say.
_HOLDS = {'llama': 'holds a dense GQA (Llama / Qwen2-style) trunk',
          'mimo': 'holds a dense GQA (Llama / Qwen2-style) model and its MTP layers',
          'deepseek_v3': 'needs MLA attention in every block (dense or MoE MLPs)'}


def _check_kind(layout: str, what: str, name: str, table: dict) -> None:
  """InteropError unless block kind `name` (of config/kinds.py's `table`) lists `layout`
  among its hf_layouts; the advice names the layouts that hold it, or says none does."""
  facts = table[name]
  if layout in facts.hf_layouts:
    return
  if facts.hf_layouts:
    advice = f'{facts.label} blocks export as --layout {" or ".join(facts.hf_layouts)}'
  else:
    held = '; '.join(f'{n} as --layout {" or ".join(f.hf_layouts)}'
                     for n, f in table.items() if f.hf_layouts)
    advice = f'no export layout holds the {what} kind {name!r}; the layouts hold {held}'
  raise InteropError(f'the {layout} layout {_HOLDS[layout]}; {advice}')


def _swiglu(pre: str, at: tuple, d: int, f: int, fp8: bool, experts: int = 0) -> list[Tensor]:
  if experts:
    return [Tensor(f'{pre}.experts.{{j}}.{p}.weight', at + ('experts', p), 'T', shape,
                   experts=experts, fp8=fp8)
            for p, shape in (('gate_proj', (f, d)), ('up_proj', (f, d)), ('down_proj', (d, f)))]
  return [Tensor(f'{pre}.{p}.weight', at + (p, 'kernel'), 'T', shape, fp8=fp8)
          for p, shape in (('gate_proj', (f, d)), ('up_proj', (f, d)), ('down_proj', (d, f)))]


def _attention(pre: str, at: tuple, args: ModelArgs, kind, bias: str, fp8: bool) -> list[Tensor]:
  """bias: '' none, 'own' the model's q/k/v biases, 'zero' zeros (MiMo without biases)."""
  d, n = args.d_model, args.n_heads
  if kind is layers.Attention:
    k, h = args.n_kv_heads, args.head_dim
    out = [Tensor(f'{pre}.o_proj.weight', at + ('o_proj', 'kernel'), 'out_heads', (d, n * h))]
    for name, heads in (('q_proj', n), ('k_proj', k), ('v_proj', k)):
      out.append(Tensor(f'{pre}.{name}.weight', at + (name, 'kernel'), 'in_heads',
                        (heads * h, d)))
      if bias == 'own':
        out.append(Tensor(f'{pre}.{name}.bias', at + (name, 'bias'), 'bias_heads',
                          (heads * h,)))
      elif bias == 'zero':
        out.append(Tensor(f'{pre}.{name}.bias', None, 'zero', (heads * h,)))
    return out
  qr, kvr = args.q_lora_rank, args.kv_lora_rank
  dn, dr, dv = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
  out = []
  if qr:
    out += [Tensor(f'{pre}.q_a_proj.weight', at + ('q_a_proj', 'kernel'), 'T', (qr, d), fp8=fp8),
            Tensor(f'{pre}.q_a_layernorm.weight', at + ('q_a_layernorm', 'scale'), 'copy', (qr,)),
            Tensor(f'{pre}.q_b_proj.weight', at + ('q_b_proj', 'kernel'), 'in_heads',
                   (n * (dn + dr), qr), rope_start=dn, fp8=fp8)]
  else:
    out.append(Tensor(f'{pre}.q_proj.weight', at + ('q_proj', 'kernel'), 'in_heads',
                      (n * (dn + dr), d), rope_start=dn, fp8=fp8))
  out += [Tensor(f'{pre}.kv_a_proj_with_mqa.weight', at + ('kv_a_proj_with_mqa', 'kernel'), 'T',
                 (kvr + dr, d), rope_start=kvr, fp8=fp8),
          Tensor(f'{pre}.kv_a_layernorm.weight', at + ('kv_a_layernorm', 'scale'), 'copy',
                 (kvr,)),
          Tensor(f'{pre}.kv_b_proj.weight', at + ('kv_b_proj', 'kernel'), 'in_heads',
                 (n * (dn + dv), kvr), fp8=fp8),
          Tensor(f'{pre}.o_proj.weight', at + ('o_proj', 'kernel'), 'out_heads', (d, n * dv),
                 fp8=fp8)]
  return out


def _block(pre: str, at: tuple, args: ModelArgs, layer: int, bias: str, fp8: bool) -> list:
  attn_cls, mlp_cls = block_classes(args, layer)
  d = args.d_model
  out = [Tensor(f'{pre}.input_layernorm.weight', at + ('input_layernorm', 'scale'), 'copy', (d,)),
         Tensor(f'{pre}.post_attention_layernorm.weight',
                at + ('post_attention_layernorm', 'scale'), 'copy', (d,))]
  out += _attention(f'{pre}.self_attn', at + ('self_attn',), args, attn_cls, bias, fp8)
  m, mp = f'{pre}.mlp', at + ('mlp',)
  if mlp_cls is layers.MLP:
    return out + _swiglu(m, mp, d, args.mlp_dim, fp8)
  e, f = args.n_routed_experts, args.moe_intermediate_size
  out += [Tensor(f'{m}.gate.weight', mp + ('gate', 'kernel'), 'T', (e, d)),
          Tensor(f'{m}.gate.e_score_correction_bias', mp + ('gate', 'e_score_correction_bias'),
                 'copy', (e,))]
  out += _swiglu(m, mp, d, f, fp8, experts=e)
  if args.n_shared_experts:
    out += _swiglu(f'{m}.shared_experts', mp + ('shared_experts',), d,
                   f * args.n_shared_experts, fp8)
  return out


def mtp_prefix(layout: str, args: ModelArgs, k: int) -> str:
  """Name prefix of MTP depth k (1-based)."""
  if layout == 'deepseek_v3':
    return f'model.layers.{args.n_layers + k - 1}'
  return f'model.mtp_layers.{k - 1}'


def tensor_table(args: ModelArgs, layout: str, depths: int | None = None) -> list[Tensor]:
  """Every tensor of `args` in `layout`: the trunk and MTP depths 1..depths (default: the
  model's; none in the llama layout). A tied model writes lm_head too, as a copy (vLLM's
  MTP loaders read it; tying loaders skip it) that may be absent on import."""
  check_layout(args, layout)
  depths = (0 if layout == 'llama' else args.mtp_depth) if depths is None else depths
  d, v = args.d_model, args.vocab_size
  fp8 = layout == 'deepseek_v3'
  bias = ('own' if args.attention_bias else ('zero' if layout == 'mimo' else '')
          ) if layout != 'deepseek_v3' else ''
  out = [Tensor('model.embed_tokens.weight', ('embed', 'embedding'), 'copy', (v, d)),
         Tensor('model.norm.weight', ('norm', 'scale'), 'copy', (d,))]
  if not args.tie_embeddings:
    out.append(Tensor('lm_head.weight', ('lm_head', 'kernel'), 'T', (v, d)))
  else:
    out.append(Tensor('lm_head.weight', None, 'alias', (v, d), of='model.embed_tokens.weight'))
  for i in range(args.n_layers):
    out += _block(f'model.layers.{i}', ('layers', str(i)), args, i, bias, fp8)
  for k in range(1, depths + 1):
    pre, at = mtp_prefix(layout, args, k), ('mtp', str(k - 1))
    if layout == 'mimo':
      names = ('token_layernorm', 'hidden_layernorm', 'input_proj', 'final_layernorm')
    else:
      names = ('enorm', 'hnorm', 'eh_proj', 'shared_head.norm')
    out += [Tensor(f'{pre}.{names[0]}.weight', at + ('enorm', 'scale'), 'copy', (d,)),
            Tensor(f'{pre}.{names[1]}.weight', at + ('hnorm', 'scale'), 'copy', (d,)),
            Tensor(f'{pre}.{names[2]}.weight', at + ('eh_proj', 'kernel'), 'T', (d, 2 * d),
                   swap_halves=layout == 'mimo'),
            Tensor(f'{pre}.{names[3]}.weight', at + ('shared_head', 'norm', 'scale'), 'copy',
                   (d,))]
    if layout == 'deepseek_v3':
      out += [Tensor(f'{pre}.embed_tokens.weight', None, 'alias', (v, d),
                     of='model.embed_tokens.weight'),
              Tensor(f'{pre}.shared_head.head.weight', None, 'alias', (v, d),
                     of='lm_head.weight')]
    out += _block(pre, at + ('block',), args, args.n_layers, bias, fp8)
  return out


def fp8_names(table: list[Tensor]) -> set[str]:
  """The Hugging Face names an FP8 export quantises."""
  return {n for t in table if t.fp8 for n in t.names() if fp8_lib.in_release(n)}


# -- one tensor, both directions ----------------------------------------------------------
def _swap(w: np.ndarray) -> np.ndarray:
  half = w.shape[1] // 2
  return np.concatenate([w[:, half:], w[:, :half]], axis=1)


def to_param(t: Tensor, ws: list[np.ndarray], shape: tuple) -> np.ndarray:
  """The parameter (shape `shape`) from its torch tensor(s) (one per expert for a stack)."""
  if t.experts:
    return np.stack([w.T for w in ws])
  w = _swap(ws[0]) if t.swap_halves else ws[0]
  p = (w if t.kind in ('copy', 'bias_heads') else w.T).reshape(shape)
  return rope_to_half(p, t.rope_start) if t.rope_start is not None else p


def to_hf(t: Tensor, p: np.ndarray) -> list[np.ndarray]:
  """The torch tensor(s) of parameter `p` (the inverse of to_param)."""
  p = np.asarray(p)
  if t.experts:
    return [np.ascontiguousarray(p[j].T) for j in range(t.experts)]
  if t.rope_start is not None:
    p = rope_to_pairs(p, t.rope_start)
  if t.kind in ('copy', 'bias_heads'):
    w = p.reshape(t.shape)
  else:
    w = p.reshape(t.shape[::-1]).T
  return [np.ascontiguousarray(_swap(w) if t.swap_halves else w)]


def _rows(s: slice, size: int, h: int) -> slice:
  """Rows [a*h, b*h) of a [heads*h, ...] tensor for head slice s = [a, b)."""
  a, b, _ = s.indices(size)
  return slice(a * h, b * h)


def block_index(t: Tensor, index: tuple, shape: tuple):
  """(index into the torch tensor, how to turn that block into P[index]) for a sliceable
  tensor; P has shape `shape`."""
  if t.kind == 'copy':
    return index, lambda b: b
  if t.kind == 'T':
    return (index[1], index[0]), lambda b: b.T
  if t.kind == 'in_heads':  # [d, n, h] <- W[n*h, d]
    sd, sn, sh = index
    _, n, h = shape
    return (_rows(sn, n, h), sd), lambda b: b.T.reshape(b.shape[1], -1, h)[:, :, sh]
  if t.kind == 'out_heads':  # [n, h, d] <- W[d, n*h]
    sn, sh, sd = index
    n, h, _ = shape
    return (sd, _rows(sn, n, h)), lambda b: b.T.reshape(-1, h, b.shape[0])[:, sh, :]
  if t.kind == 'bias_heads':  # [n, h] <- b[n*h]
    sn, sh = index
    n, h = shape
    return (_rows(sn, n, h),), lambda b: b.reshape(-1, h)[:, sh]
  raise ValueError(f'tensor kind {t.kind!r} has no blocks')
