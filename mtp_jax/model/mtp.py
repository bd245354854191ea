"""The model: the main decoder and its M multi-token-prediction modules (docs/design.md
sections 1-2), trained teacher-forced (`__call__`) and run through KV caches by the decoder
(the decode_* methods). `Emb` and `OutHead` are shared by every depth; the MTP modules are
the classes of mtp_jax/model/heads.py, their arguments mtp_jax/model/args.py's ModelArgs,
the block stacks run by mtp_jax/model/blocks.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax
import mtp_jax.model.attention as attn_lib
import mtp_jax.model.context as context_lib
import mtp_jax.model.decode_ops as decode_ops
import mtp_jax.model.layers as layers
import mtp_jax.model.pipeline as pipeline
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.blocks import block_classes, run_blocks
from mtp_jax.model.heads import vocab_logits
from mtp_jax.runtime.sharding import constrain

Array = jax.Array


def shift_left(x_BxT: Array, k: int, fill=0) -> Array:
  """x[:, i + k] at position i; the last k positions hold `fill` (static shape). In context
  parallelism's balanced layout, i and i + k are natural positions (context.Layout)."""
  if k == 0:
    return x_BxT
  layout = context_lib.active()
  if layout is not None and layout.length == x_BxT.shape[1]:
    return layout.shift_left(x_BxT, k, fill)
  k = min(k, x_BxT.shape[1])  # k >= T: all fill, still length T
  pad = jnp.full((x_BxT.shape[0], k) + x_BxT.shape[2:], fill, x_BxT.dtype)
  return jnp.concatenate([x_BxT[:, k:], pad], axis=1)


class MTPModel(nnx.Module):
  """Main decoder + M MTP modules sharing one embedding and one output head."""

  def __init__(self, args: ModelArgs, *, rngs: nnx.Rngs):
    # Parameters are placed on devices by jit out_shardings (sharding.py), not eagerly,
    # so the model also builds outside a mesh (tests, notebooks).
    with nnx.use_eager_sharding(False):
      self.args = args
      self.embed = nnx.Embed(
          args.vocab_size, args.d_model, dtype=args.dtype,
          embedding_init=nnx.with_partitioning(
              nnx.initializers.normal(args.init_std), ('vocab', 'embed')), rngs=rngs)
      self.layers = nnx.List([layers.Block(args, rngs, *block_classes(args, i))
                              for i in range(args.n_layers)])
      self.norm = layers.rms_norm(args.d_model, args, rngs)
      if not args.tie_embeddings:
        self.lm_head = nnx.Linear(
            args.d_model, args.vocab_size, use_bias=False, dtype=args.dtype,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ('embed', 'vocab')),
            rngs=rngs)
      head = args.mtp_head()
      self.mtp = nnx.List([head(args, rngs) for _ in range(args.mtp_modules())])

  # -- pieces, also used by the decoder ----------------------------------------------
  def embed_tokens(self, tokens_BxT: Array) -> Array:
    return constrain(self.embed(tokens_BxT), ('batch', 'length', 'act_embed'))

  def head_norm(self, k: int) -> nnx.RMSNorm:
    """The norm before OutHead: the final norm (k = 0) or depth k's shared_head.norm."""
    return self.norm if k == 0 else self.mtp_module(k).shared_head.norm

  def output_kernel(self) -> Array:
    """OutHead as a [D, V] matrix (the embedding transposed when tied)."""
    if self.args.tie_embeddings:
      return self.embed.embedding[...].T
    return self.lm_head.kernel[...]

  def logits(self, h_BxTxD: Array, k: int = 0) -> Array:
    """OutHead(norm_k(h)) in float32: the main head (k = 0) or depth k's."""
    return vocab_logits(self.head_norm(k), h_BxTxD, self.output_kernel())

  def trunk(self, tokens_BxT, positions_BxT, mask_Bx1xTxT) -> Array:
    """h^0: the last block's output, before the final norm."""
    x = self.embed_tokens(tokens_BxT)
    run = functools.partial(run_blocks, remat=self.args.remat, scan=self.args.scan_layers)
    s = self.args.pipeline_stages
    if s > 1:  # S stages over the 'stage' mesh axis; never changes parameters
      return pipeline.run_stages(self.layers, x, positions_BxT, mask_Bx1xTxT, s,
                                 self.args.pipeline_microbatches or s, run)
    return run(self.layers, x, positions_BxT, mask_Bx1xTxT)

  def mtp_embed(self, tokens_BxT: Array) -> Array:
    """Emb(t_(i+k)) as an MTP input: detached from the shared table under stop_gradient."""
    x = self.embed_tokens(tokens_BxT)
    return jax.lax.stop_gradient(x) if self.args.stop_gradient else x

  def mtp_step(self, k: int, h_prev_BxTxD, tokens_BxT, positions_BxT, mask, cache=None,
               cache_index_B=None):
    """h^k from h^{k-1} (sequential) or h^0 (parallel); tokens_BxT are t_{i+k} at i."""
    module = self.mtp_module(k)
    x = module.block_input(h_prev_BxTxD, tokens_BxT, self.embed_tokens)
    return module.block(x, positions_BxT, mask, cache, cache_index_B)

  # -- the decode path: few-token steps through KV caches (layers.Block.decode) --------
  def for_decoding(self, layout: str) -> MTPModel:
    """A copy of the model in the decode layout (decode_ops.DecodeWeight) for cache `layout`.

    It shares this model's norms and embedding and holds every other matrix transposed
    (O x I, q/k/v and gate/up fused; MLA's and MoE's: their prepare_decode) for
    decode_ops.decode_dot; the 'bskh' layout keeps the
    blocks' kernels (it runs __call__, the library path). The copy runs the decode_*
    methods only: its blocks may lack what __call__ and the training path read.
    """
    model = nnx.merge(*nnx.split(self))  # new modules over the same arrays
    for block in model.layers:
      block.prepare_decode(layout)
    for module in model.mtp:
      module.prepare_decode(layout)
    if not model.args.tie_embeddings:
      model.head_t = decode_ops.DecodeWeight(decode_ops.decode_kernel(model.lm_head.kernel))
      del model.lm_head
    return model

  def trunk_caches(self, batch: int, slots: int, layout: str) -> tuple:
    """Zero caches of the trunk's layers (Block.empty_cache), for decode_trunk."""
    return tuple(block.empty_cache(batch, slots, layout) for block in self.layers)

  def mtp_caches(self, num_drafts: int, batch: int, slots: int, layout: str) -> tuple:
    """Zero caches of drafting depths 1..num_drafts (mtp_module's blocks)."""
    return tuple(self.mtp_module(k).block.empty_cache(batch, slots, layout)
                 for k in range(1, num_drafts + 1))

  def mtp_module(self, k: int):
    """Module of depth k; depths past M reuse the last module (recursive drafts), and under
    share_modules every depth runs the one module."""
    return self.mtp[self.args.module_index(k)]

  def decode_embed(self, tokens_BxT: Array) -> Array:
    """Emb rows in the activations' dtype (gathering first: the table may be bfloat16)."""
    return jnp.take(self.embed.embedding[...], tokens_BxT, axis=0).astype(self.args.dtype)

  def decode_logits(self, h_BTxD: Array, k: int = 0) -> Array:
    """logits(h, k) for a few rows [N, D] (decode_ops.decode_dot's rule), float32.

    The tied head is the embedding table itself, already [V, D] (O x I)."""
    norm = self.norm if k == 0 else self.mtp_module(k).shared_head.norm
    w_VxD = self.embed.embedding[...] if self.args.tie_embeddings else self.head_t[...]
    return decode_ops.decode_dot(norm(h_BTxD), w_VxD).astype(jnp.float32)

  def decode_trunk(self, tokens_BxT, positions_BxT, mask, caches, cache_index_B, layout):
    """h^0 of new tokens through the trunk's per-layer caches; (h, new caches)."""
    x = self.decode_embed(tokens_BxT)
    new = []
    for block, cache in zip(self.layers, caches):
      x, cache = block.decode(x, positions_BxT, mask, cache, cache_index_B, layout)
      new.append(cache)
    return x, tuple(new)

  def decode_mtp_step(self, k: int, h_prev_BxTxD, tokens_BxT, positions_BxT, mask, cache,
                      cache_index_B, layout):
    """mtp_step through a cache (k may exceed M: see mtp_module); (h^k, new cache)."""
    module = self.mtp_module(k)
    x = module.block_input(h_prev_BxTxD, tokens_BxT, self.decode_embed, decode=True)
    return module.block.decode(x, positions_BxT, mask, cache, cache_index_B, layout)

  def __call__(self, tokens_BxT: Array, positions_BxT: Array | None = None,
               segment_ids_BxT: Array | None = None) -> list[Array]:
    """Hidden states [h^0, h^1, ..., h^M], each [B, T, D], for teacher-forced training.

    Sequential depth k reads the true tokens t_{i+a_k} (shifted left by a_k = o_k - 1,
    o_k = k + 1 unless model.mtp.target_offsets says otherwise; strict_leaps:
    ModelArgs.input_offsets; the tail is padding and is masked out by the loss).
    """
    b, t = tokens_BxT.shape[:2]
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids_BxT is None:
      segment_ids_BxT = jnp.ones((b, t), jnp.int32)
    mask = attn_lib.training_mask(segment_ids_BxT, attn_lib.attention_impl(self.args))
    h0 = self.trunk(tokens_BxT, positions_BxT, mask)
    hiddens = [h0]
    detach = self.args.detach_trunk or self.args.stop_gradient
    h = jax.lax.stop_gradient(h0) if detach else h0
    if self.args.scan_layers and self.args.mtp_depth > 1 and not self.args.share_modules:
      return hiddens + self._scan_depths(h, tokens_BxT, positions_BxT, mask)
    reads = self.args.input_offsets()
    chained = self.args.mtp_head().chained
    for k in range(1, self.args.mtp_depth + 1):
      module = self.mtp_module(k)  # shared: one module's parameters, its gradient summed
      x = module.block_input(h, shift_left(tokens_BxT, reads[k - 1]), self.mtp_embed)
      if not module.has_block:  # TOP: its head reads h^0 itself
        hiddens.append(x)
        continue
      hk = run_blocks([module.block], x, positions_BxT, mask, self.args.remat)
      hiddens.append(hk)
      h = hk if chained else h
    return hiddens

  def _scan_depths(self, h0, tokens_BxT, positions_BxT, mask) -> list[Array]:
    """[h^1 .. h^M] by one lax.scan over the depths' stacked parameters.

    XLA runs the depths strictly one after another and reuses one depth's buffers for
    the next, so (with remat) step memory stays nearly flat in M; unrolled, XLA:CPU's
    scheduler keeps several depths' recomputed activations alive at once.
    """
    graphdef, _ = nnx.split(self.mtp[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(m) for m in self.mtp])
    chained = self.args.mtp_head().chained
    tokens_MxBxT = jnp.stack([shift_left(tokens_BxT, a) for a in self.args.input_offsets()])

    def body(h, xs):
      state, tokens = xs
      module = nnx.merge(graphdef, state)
      x = module.block_input(h, tokens, self.mtp_embed)
      hk = run_blocks([module.block], x, positions_BxT, mask, self.args.remat)
      return (hk if chained else h), (hk, nnx.state(module, nnx.Intermediate))

    _, (h_MxBxTxD, stats_M) = jax.lax.scan(body, h0, (stacked, tokens_MxBxT))
    for k, module in enumerate(self.mtp):  # the MoE statistics onto each depth (moe.collect)
      nnx.update(module, jax.tree.map(lambda a, k=k: a[k], stats_M))
    return list(h_MxBxTxD)


def count_params(model: nnx.Module) -> dict[str, int]:
  """Parameter counts: total, trunk (embedding, blocks, final norm, head), mtp."""
  state = nnx.state(model, nnx.Param)
  total = sum(x.size for x in jax.tree.leaves(state))
  mtp = sum(x.size for x in jax.tree.leaves(nnx.state(model.mtp, nnx.Param)))
  return {'total': int(total), 'trunk': int(total - mtp), 'mtp': int(mtp)}


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
