"""DeepSeekMoE (DeepSeek-V3 report section 2.1.2), an MLP option of the blocks.

  s_i   = sigmoid(u W_gate)_i                         affinity of routed expert i
  top-k by s_i + b_i                                  b: routing bias, selection only
                                                      (within the top `topk_group` of
                                                      `n_group` expert groups, below)
  g_i   = routed_scaling_factor * s_i / sum_{j in top-k} s_j   for selected i, else 0
  out   = shared_experts(u) + sum_i g_i FFN_i(u)

Auxiliary-loss-free balancing: b is a non-trainable `RoutingBias` variable (not an
nnx.Param, so neither the gradient nor the optimizer ever sees it), updated once per
train step by `update_bias`: b_i += gamma * sign(mean load - load_i), load_i = tokens
routed to expert i in the step. A small sequence-wise balance loss (eqs. 17-20),
  L_bal = alpha * sum_i f_i P_i,  f_i = E / (Ek T) * #{t : i in top-k(t)},
  P_i = mean_t s_i,t / sum_j s_j,t            (per sequence, then averaged),
is added to the training loss by loss.py.

Node-limited routing (report section 2.1.2, "each token will be sent to at most M
nodes"): the E experts form `n_group` equal groups (one per node in DeepSeek-V3: 8 groups
of 32, M = topk_group = 4); a group's score is the sum of its two highest s_i + b_i, and
a token picks its top-k experts only inside its `topk_group` best groups. With
n_group = 1 (the default) this is plain top-k. Like the bias, the group choice only
selects: the gates stay the normalised affinities of the chosen experts.

Dispatch is dropless and sort-based: the BT Ek (token, expert) pairs are sorted by expert,
and each expert's contiguous group is multiplied by its weights in a grouped matmul, in
one of three forms (`model.moe.dispatch`):
  'ragged'  `jax.lax.ragged_dot`: the grouped-GEMM primitive that GPU / TPU lower to a
            kernel. On XLA:CPU (jax 0.10.2) it lowers to a masked dense product: x is
            broadcast to [E, BTEk, D] and every expert multiplies every row, E times the
            active FLOPs (measured: 2048 rows, D 128, F 96: 16 ms at E = 8, 299 ms at
            E = 32, against 0.9 ms for one dense dot of the same rows). On TPU its
            gradient for the weights is expanded into a dense product over every expert.
  'blocks'  each expert's group padded to a multiple of a block of Jr rows, so that every
            block belongs to one expert: one batched matmul of the blocks with their
            experts' (gathered) weights. It costs the active FLOPs plus at most
            E (Jr - 1) padding rows, and gathers one weight copy per block.
  'gmm'     the TPU grouped-matmul kernel (Pallas megablox `gmm`, its weight gradient
            `tgmm`): only the grouped rows are computed, forward and backward.
  'auto'    'blocks' on CPU, 'gmm' on TPU (training), 'ragged' on GPU (the default).

Under a mesh the dispatch runs per device (expert_parallel_swiglu, in jax.shard_map), the
experts split over the expert mesh axes (X devices of an expert group, Ed = E / X experts each).
`model.moe.exchange` picks how rows reach their experts:
  'all_to_all' (the default) each device sorts its own BT Ek rows by expert and sends each
            row once to the device holding its expert by `jax.lax.ragged_all_to_all`
            (model/moe_exchange.py; on CPU, which cannot run that collective, an exact
            emulation moving the same rows); that device multiplies what it receives in
            one grouped matmul and the outputs return by the reverse exchange, gated where
            the tokens live. Dropless by default; `model.moe.capacity_factor` > 0 bounds
            the receive buffers and counts the rows it drops (moe_exchange.buffer_rows).
  'all_gather' each device all-gathers the tokens of its expert group, multiplies the rows
            routed to its own experts, and reduce-scatters the gated outputs back.
No expert's weights leave the devices that hold them except along their FSDP axes. Both
exchanges are exact (dropless), forward and gradients, with or without a mesh
(tests/test_moe.py). Sorting and the gather / scatter are O(BT Ek log(BT Ek)) and O(BT Ek D).
Padding positions are routed (and counted in the load) like any token. Under
remat='block' the grouped products' outputs are saved (EXPERT_SAVED_NAME) where their
rows are the rows computed: without a mesh, and under the all-to-all exchange with a
capacity factor; the worst-case buffers (all_gather, dropless all_to_all: X BT Ek rows)
are recomputed instead, as saving them would hold P times the rows.

Every MoE call leaves its statistics on the module as nnx.Intermediate variables
(`expert_load` [E], `balance` []); model.run_blocks carries them out of its pure block
functions (and out of its scans, model.scan_layers), and `collect` pops them after a
forward pass.

Decoding (`prepare_decode` / `decode`, as layers.MLP): the same routing (`route`), the
shared experts through layers.MLP's decode path, and for a few tokens (BT Ek <= E) each
token's Ek experts' weights gathered and applied directly (gathered_swiglu), no sort;
more rows (a prefill) take the dispatch above. No statistics are left in decoding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import mtp_jax.model.decode_ops as decode_ops
import mtp_jax.model.layers as layers
import mtp_jax.model.matmul as matmul
import mtp_jax.model.moe_exchange as moe_exchange
from mtp_jax.config import kinds
from mtp_jax.runtime.sharding import constrain, logical_spec

Array = jax.Array


class RoutingBias(nnx.Variable):
  """The aux-loss-free routing bias: state, but never a trainable parameter."""


def _init(names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Router(nnx.Module):
  """DeepSeek-V3's `mlp.gate`: the affinity kernel and `e_score_correction_bias`."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    e = cfg.n_routed_experts
    self.kernel = nnx.Param(_init(('embed', None))(rngs.params(), (cfg.d_model, e)))
    self.e_score_correction_bias = RoutingBias(jnp.zeros((e,), jnp.float32))


class Experts(nnx.Module):
  """E SwiGLU experts with stacked [E, ...] kernels (sharded over the `expert` axis)."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    e, d, f = cfg.n_routed_experts, cfg.d_model, cfg.moe_intermediate_size
    self.gate_proj = nnx.Param(_init(('expert', 'embed', 'mlp'))(rngs.params(), (e, d, f)))
    self.up_proj = nnx.Param(_init(('expert', 'embed', 'mlp'))(rngs.params(), (e, d, f)))
    self.down_proj = nnx.Param(_init(('expert', 'mlp', 'embed'))(rngs.params(), (e, f, d)))


def route(scores_BTxE: Array, bias_E: Array, k: int, scaling: float, n_group: int = 1,
          topk_group: int = 1) -> tuple[Array, Array]:
  """(expert ids [BT, Ek], gates [BT, Ek]): top-k of scores + bias inside each token's best
  `topk_group` of `n_group` expert groups (all experts when n_group == 1), gates from
  the scores alone."""
  sel_BTxE = scores_BTxE + bias_E
  if n_group > 1:
    n, e = sel_BTxE.shape
    grouped_BTxGexEg = sel_BTxE.reshape(n, n_group, e // n_group)
    group_BTxGe = jnp.sum(jax.lax.top_k(grouped_BTxGexEg, min(2, e // n_group))[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_BTxGe, topk_group)
    keep_BTxGe = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best_groups].set(True)
    keep_BTxE = jnp.repeat(keep_BTxGe, e // n_group, axis=1)
    sel_BTxE = jnp.where(keep_BTxE, sel_BTxE, -jnp.inf)
  _, idx_BTxEk = jax.lax.top_k(sel_BTxE, k)
  s_BTxEk = jnp.take_along_axis(scores_BTxE, idx_BTxEk, axis=-1)
  return idx_BTxEk, scaling * s_BTxEk / jnp.sum(s_BTxEk, axis=-1, keepdims=True)


def balance_loss(scores_BxTxE: Array, idx_BxTxEk: Array) -> Array:
  """sum_i f_i P_i per sequence, averaged over the batch (without alpha)."""
  e, k, t = scores_BxTxE.shape[-1], idx_BxTxEk.shape[-1], scores_BxTxE.shape[1]
  hits_BxE = jax.nn.one_hot(idx_BxTxEk, e, dtype=jnp.float32).sum(axis=(1, 2))
  f_BxE = hits_BxE * e / (k * t)
  p_BxE = jnp.mean(scores_BxTxE / jnp.sum(scores_BxTxE, -1, keepdims=True), axis=1)
  return jnp.mean(jnp.sum(f_BxE * p_BxE, axis=-1))


DISPATCHES = kinds.MOE_DISPATCHES  # model.moe.dispatch's names (config/kinds.py)
# The name of the grouped products' outputs (gate, up and down projections of the routed
# experts): remat='block' (model.remat_policy) saves them rather than rerunning the kernel.
EXPERT_SAVED_NAME = 'moe_expert_products'


def resolve_dispatch(dispatch: str, per_device: bool = True, backward: bool = True) -> str:
  """The grouped-matmul form for `dispatch` on this backend. On TPU, 'auto' takes the gmm
  kernel where the product runs on one device's rows (`per_device`: no mesh, or inside the
  expert-parallel shard_map) and is differentiated (`backward`): its weight gradient is
  what ragged_dot gets wrong there; ragged_dot's forward is a TPU kernel already, so
  decoding and GSPMD-partitioned meshes keep it."""
  if dispatch == 'auto':
    backend = jax.default_backend()
    if backend == 'cpu':
      return 'blocks'
    return 'gmm' if backend == 'tpu' and per_device and backward else 'ragged'
  return dispatch


def block_rows(m: int, num_experts: int) -> int:
  """Rows per block (Jr) for m sorted rows over E experts: a power of two near m / (2E), so
  that the padding (at most E (Jr - 1) rows) stays about half of m or less, in [8, 128]."""
  target = max(1, m // (2 * num_experts))
  return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def block_layout(sizes_E: Array, m: int, block: int) -> tuple[Array, Array, int]:
  """(slot [m]: each sorted row's row in the padded buffer, expert of each block [J], J):
  expert e's rows start at a multiple of `block`. J = ceil(M / B) + min(E, M) bounds the
  blocks any split of M rows into E groups can need."""
  e = sizes_E.shape[0]
  padded_E = (sizes_E + block - 1) // block * block
  end_pad_E = jnp.cumsum(padded_E)
  start_pad_E, start_E = end_pad_E - padded_E, jnp.cumsum(sizes_E) - sizes_E
  rows_BTEk = jnp.arange(m)
  expert_BTEk = jnp.searchsorted(jnp.cumsum(sizes_E), rows_BTEk, side='right')
  slot_BTEk = start_pad_E[expert_BTEk] + rows_BTEk - start_E[expert_BTEk]
  n_blocks = -(-m // block) + min(e, m)
  block_expert_J = jnp.searchsorted(end_pad_E, jnp.arange(n_blocks) * block, side='right')
  return slot_BTEk, jnp.minimum(block_expert_J, e - 1), n_blocks


def _common_tile(a: int, b: int) -> int | None:
  """A TPU tile for both dims of a product and of its transpose: the largest of 512, 256,
  128 dividing both, or None."""
  return next((t for t in (512, 256, 128) if a % t == 0 and b % t == 0), None)


def _gmm(a_BTEkxI: Array, w_ExIxO: Array, sizes_E: Array, interpret: bool = False,
         mask: bool = True) -> Array:
  """The TPU grouped-matmul kernel (Pallas megablox): only the G groups' rows are
  computed, and its gradient for the weights is a grouped product too (`tgmm`). The
  kernel leaves rows past sum(sizes) unwritten, in its output and in its input's
  gradient; `mask`: both are masked to zero here. Without it they hold whatever was
  there, which only a caller that never reads them may use: the kernel stores and the
  weight gradient's loads select by group, so such rows reach no other row or weight."""
  # Deferred: the Pallas TPU kernels load only where this form is chosen.
  from jax.experimental.pallas.ops.tpu.megablox import gmm
  m, i = a_BTEkxI.shape
  tm = 128 if m >= 128 else max(8, 1 << (m - 1).bit_length())
  pad = -m % tm
  a = jnp.pad(a_BTEkxI, ((0, pad), (0, 0))) if pad else a_BTEkxI
  if mask:
    valid = (jnp.arange(m + pad) < jnp.sum(sizes_E))[:, None]
    a = jnp.where(valid, a, 0)
  t = _common_tile(i, w_ExIxO.shape[2])
  tiling = (tm, t, t)  # the backward pass multiplies by the transpose with the same tiles
  out = gmm(a, w_ExIxO, sizes_E.astype(jnp.int32), a_BTEkxI.dtype, tiling, None, None, False,
            interpret)
  return (jnp.where(valid, out, 0) if mask else out)[:m]


def grouped_products(xs_BTEkxD: Array, sizes_E: Array, ws, form: str,
                     interpret: bool = False, save: bool = True,
                     rows_past_groups_read: bool = True) -> Array:
  """[rows, D]: the SwiGLU of rows sorted by expert, expert e taking the sizes_E[e] rows after
  the groups before it; rows past sum(sizes_E) come out zero. `ws`: the gate, up and down
  kernels [E, D, F], [E, D, F], [E, F, D]; `form`: 'ragged', 'blocks' or 'gmm'. `save`:
  name the products EXPERT_SAVED_NAME (kept under remat='block'); off where M is a
  worst-case buffer several times the rows computed, which keeping would hold.
  rows_past_groups_read=False: the caller never reads the rows past sum(sizes_E) (nor
  their gradient), so the 'gmm' form leaves them as the kernel does (_gmm's mask: two
  passes over the buffer per product saved)."""
  if form == 'gmm' and not all(_common_tile(*w.shape[1:]) for w in ws):
    form = 'ragged'  # the kernel tiles dims of multiples of 128 (here: sharded too finely)
  if form in ('ragged', 'gmm'):
    if form == 'ragged':
      mm = lambda a, w: jax.lax.ragged_dot(a, w, sizes_E)  # noqa: E731
    else:
      mm = lambda a, w: _gmm(a, w, sizes_E, interpret, rows_past_groups_read)  # noqa: E731
    name = lambda a: checkpoint_name(a, EXPERT_SAVED_NAME) if save else a  # noqa: E731
    h_BTEkxF = jax.nn.silu(name(mm(xs_BTEkxD, ws[0]))) * name(mm(xs_BTEkxD, ws[1]))
    return name(mm(h_BTEkxF, ws[2]))
  m, d = xs_BTEkxD.shape
  e = sizes_E.shape[0]
  rest = m - jnp.sum(sizes_E)  # rows of no group: a last block group, zeroed below
  sizes = jnp.concatenate([sizes_E, rest[None]])
  block = block_rows(m, e)
  slot_BTEk, expert_J, n_blocks = block_layout(sizes, m, block)
  expert_J = jnp.minimum(expert_J, e - 1)
  x_JxJrxD = jnp.zeros((n_blocks * block, d), xs_BTEkxD.dtype).at[slot_BTEk].set(xs_BTEkxD).reshape(
      n_blocks, block, d)
  mm = lambda a, w: (checkpoint_name if save else lambda y, _: y)(  # noqa: E731
      matmul.einsum('jbi,jio->jbo', a, w[expert_J], a.dtype), EXPERT_SAVED_NAME)
  h_JxJrxF = jax.nn.silu(mm(x_JxJrxD, ws[0])) * mm(x_JxJrxD, ws[1])
  y_BTEkxD = mm(h_JxJrxF, ws[2]).reshape(n_blocks * block, d)[slot_BTEk]
  return jnp.where((jnp.arange(m) < m - rest)[:, None], y_BTEkxD, 0)


def grouped_swiglu(x_BTxD: Array, idx_BTxEk: Array, experts: Experts, num_experts: int,
                   dtype, dispatch: str = 'auto', backward: bool = True) -> Array:
  """[BT, Ek, D]: expert idx[n, j]'s SwiGLU of token n, by sort + a grouped matmul
  (`backward`: it is differentiated, resolve_dispatch)."""
  n, k = idx_BTxEk.shape
  flat_BTEk = idx_BTxEk.reshape(-1)
  order_BTEk = jnp.argsort(flat_BTEk, stable=True)
  xs_BTEkxD = x_BTxD[order_BTEk // k].astype(dtype)
  sizes_E = jnp.bincount(flat_BTEk, length=num_experts).astype(jnp.int32)
  ws = [w[...].astype(dtype) for w in (experts.gate_proj, experts.up_proj, experts.down_proj)]
  form = resolve_dispatch(dispatch, jax.sharding.get_abstract_mesh().empty, backward)
  y_BTEkxD = grouped_products(xs_BTEkxD, sizes_E, ws, form)
  return jnp.zeros_like(y_BTEkxD).at[order_BTEk].set(y_BTEkxD).reshape(n, k, -1)


# -- expert parallelism -------------------------------------------------------------------------
def _mesh_axes(name: str) -> tuple[str, ...]:
  spec = logical_spec((name,))[0]
  return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def expert_layout() -> dict | None:
  """The mesh axes of the active rules that the per-device dispatch needs, or None when it
  does not apply (no mesh, or a rule table it does not cover: then GSPMD partitions the
  global dispatch). Applies when the experts are split over batch axes only, their model
  dim over axes other than the experts', and the expert MLP dim over neither."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return None
  ax = {n: _mesh_axes(n) for n in ('expert', 'batch', 'length', 'embed', 'mlp')}
  expert, batch, embed, mlp = (set(ax[n]) for n in ('expert', 'batch', 'embed', 'mlp'))
  if not expert <= batch or embed & expert or mlp & (batch | embed | set(ax['length'])):
    return None
  return ax


def expert_parallel_swiglu(x_BxTxD: Array, idx_BxTxEk: Array, gates_BxTxEk: Array,
                           experts: Experts, dtype, dispatch: str, ax: dict,
                           exchange: str = 'all_to_all',
                           capacity_factor: float = 0.0) -> tuple[Array, Array]:
  """([B, T, D]: sum_j gates[.., j] FFN_idx[.., j](x), rows dropped []), each device
  computing its own experts in jax.shard_map.

  exchange 'all_to_all' (model/moe_exchange.py): each device sorts its own rows by expert
  and sends each row once to the device holding its expert (ragged all-to-all over the
  expert axes), which multiplies the rows it receives in one grouped matmul and sends the
  outputs back the same way; the gates are applied where the tokens live. Per device and
  layer the exchange moves the rows routed away from it, twice (and back in the backward).
  Rows are dropped only with a capacity factor (moe_exchange.buffer_rows).

  exchange 'all_gather': the tokens of the devices that share its expert-axis coordinates
  are all-gathered over the expert axes; each device sorts all X BT Ek rows, multiplies
  those routed to its own experts (the kernel skips the rest) and the gated outputs are
  reduce-scattered back. Exact; its bytes and sort grow with P.

  Either way the device's experts' weights are all-gathered over their model-dim (FSDP)
  axes and the outputs summed over the expert-MLP axes.
  """
  k = idx_BxTxEk.shape[-1]
  expert_axes, mlp_axes = ax['expert'], ax['mlp']
  batch_spec = ax['batch'] or None
  act = P(batch_spec, ax['length'] or None, None)
  w_in = P(expert_axes or None, ax['embed'] or None, mlp_axes or None)
  w_out = P(expert_axes or None, mlp_axes or None, ax['embed'] or None)
  form = resolve_dispatch(dispatch, per_device=True)
  mesh = jax.sharding.get_abstract_mesh()
  n_dev = 1
  for a in expert_axes:
    n_dev *= mesh.shape[a]
  impl = moe_exchange.exchange_impl()

  def gathered(x, idx, gates, ws):
    if expert_axes:  # the tokens of the whole expert group
      x, idx, gates = (jax.lax.all_gather(a, expert_axes, axis=0, tiled=True)
                       for a in (x, idx, gates))
    e_local = ws[0].shape[0]
    first = jax.lax.axis_index(expert_axes) * e_local if expert_axes else 0
    local_BTEk = idx.reshape(-1) - first
    mine_BTEk = (local_BTEk >= 0) & (local_BTEk < e_local)
    key_BTEk = jnp.where(mine_BTEk, local_BTEk, e_local)  # other devices' rows sort last
    order_BTEk = jnp.argsort(key_BTEk, stable=True)
    sizes_Ed = jnp.bincount(key_BTEk, length=e_local + 1)[:e_local].astype(jnp.int32)
    token_BTEk = order_BTEk // k  # the token of each sorted row
    # X BT Ek rows, the other devices' (past the groups) not computed: not kept under remat
    y_BTEkxD = grouped_products(x[token_BTEk].astype(dtype), sizes_Ed, ws, form, save=False)
    g_BTEk = jnp.where(mine_BTEk, gates.reshape(-1), 0)[order_BTEk]
    # Each token's gated sum over its rows here, added straight from the sorted rows (no
    # [BT, Ek, D] unsort, no Ek-wide product); float32 sums, as a matmul accumulates.
    y_BTxD = jnp.zeros((x.shape[0], x.shape[1]), jnp.float32).at[token_BTEk].add(
        y_BTEkxD.astype(jnp.float32) * g_BTEk[:, None]).astype(dtype)
    if expert_axes:  # each token's own rows back, summed over the devices of its experts
      y_BTxD = jax.lax.psum_scatter(y_BTxD, expert_axes, scatter_dimension=0, tiled=True)
    return y_BTxD, jnp.zeros((), jnp.int32)

  def exchanged(x, idx, gates, ws):
    n, d = x.shape
    e_local = ws[0].shape[0]
    flat_BTEk = idx.reshape(-1)
    order_BTEk = jnp.argsort(flat_BTEk, stable=True)  # by expert, so by destination device
    counts_XxEd = jnp.bincount(flat_BTEk, length=n_dev * e_local).astype(jnp.int32).reshape(
        n_dev, e_local)
    all_counts_XsxXxEd = jax.lax.all_gather(counts_XxEd, expert_axes)
    me = jax.lax.axis_index(expert_axes)
    rows = moe_exchange.buffer_rows(n, k, n_dev, e_local, capacity_factor)
    p = moe_exchange.plan(counts_XxEd, all_counts_XsxXxEd, me, rows)
    there = (p['input_offsets'], p['send_sizes'], p['output_offsets'], p['recv_sizes'])
    back = (p['recv_offsets'], p['recv_sizes'], p['sender_offsets'], p['send_sizes'])
    # The send buffer S: the sorted rows, each destination's slice padded to whole blocks
    # (a padding row holds token 0's row; nothing reads it or its gradient).
    send_rows = moe_exchange.padded_rows(n * k, n_dev)
    dest_BTEk = flat_BTEk[order_BTEk] // e_local  # each sorted row's device
    slot_BTEk = moe_exchange.send_slots(p, dest_BTEk)
    inverse_BTEk = moe_exchange.inverse_permutation(order_BTEk)
    at_BTEk = slot_BTEk[inverse_BTEk]  # the slot of each (token, expert) row
    token_S = jnp.zeros((send_rows,), jnp.int32).at[slot_BTEk].set(order_BTEk // k)
    sent_BTxEk = None
    if capacity_factor > 0:  # the rows past a receiver's R: dropped
      sent_BTEk = moe_exchange.sent_rows(p, dest_BTEk)
      sent_BTxEk = sent_BTEk[inverse_BTEk].reshape(n, k)
    xs_SxD = moe_exchange.token_rows(x, token_S, at_BTEk.reshape(n, k), sent_BTxEk, dtype)
    # Buffers the exchange does not zero first: rows nothing lands in (and padding) are
    # sorted past the groups (key Ed), which nothing reads, and go back to padding rows.
    recv_rows = moe_exchange.padded_rows(rows, n_dev)
    recv_YxD = moe_exchange.exchange(recv_rows, expert_axes, impl, xs_SxD, there, back)
    key_Y = moe_exchange.received_experts(p, all_counts_XsxXxEd[:, me], recv_rows)
    order_Y = jnp.argsort(key_Y, stable=True)
    inverse_Y = moe_exchange.inverse_permutation(order_Y)
    sizes_Ed = jnp.bincount(key_Y, length=e_local + 1)[:e_local].astype(jnp.int32)
    # kept under remat only where a capacity factor bounds the buffer (dropless: X BT Ek rows)
    # Rows nothing landed in sort past the groups; nothing reads them or their gradient
    # (the reverse exchange sends back only the rows received).
    y_sorted_YxD = grouped_products(moe_exchange.take_rows(recv_YxD, order_Y, inverse_Y),
                                    sizes_Ed, ws, form, save=capacity_factor > 0,
                                    rows_past_groups_read=False)
    y_YxD = moe_exchange.take_rows(y_sorted_YxD, inverse_Y, order_Y)
    # The reverse exchange: each received slice back to its sender, where it came from.
    back_SxD = moe_exchange.exchange(send_rows, expert_axes, impl, y_YxD, back, there)
    # back in token order, each token's Ek rows side by side ([BT, Ek D], compute dtype),
    # and its gated sum over them as Ek slices of that row added elementwise (float32
    # products and sums, as a matmul accumulates). On TPU this is one elementwise pass; a
    # reduction over the Ek axis of [BT, Ek, D] is priced about three times as much.
    back_BTxEkD = moe_exchange.take_rows(back_SxD, at_BTEk, moe_exchange.slot_sources(
        at_BTEk, send_rows)).reshape(n, k * d)
    gates_BTxEk = gates.astype(jnp.float32)
    y_BTxD = jnp.zeros((n, d), jnp.float32)
    for j in range(k):
      term_BTxD = back_BTxEkD[:, j * d:(j + 1) * d].astype(jnp.float32) * gates_BTxEk[:, j:j + 1]
      if sent_BTxEk is not None:
        term_BTxD = jnp.where(sent_BTxEk[:, j:j + 1], term_BTxD, 0)
      y_BTxD = y_BTxD + term_BTxD
    return y_BTxD.astype(dtype), p['dropped']

  def local(x, idx, gates, wg, wu, wd):
    b, t, d = x.shape
    x, idx, gates = x.reshape(b * t, d), idx.reshape(b * t, k), gates.reshape(b * t, k)
    if ax['embed']:  # this device's experts, whole in the model dim
      wg, wu = (jax.lax.all_gather(w, ax['embed'], axis=1, tiled=True) for w in (wg, wu))
      wd = jax.lax.all_gather(wd, ax['embed'], axis=2, tiled=True)
    ws = [w.astype(dtype) for w in (wg, wu, wd)]
    run = exchanged if exchange == 'all_to_all' and expert_axes else gathered
    y_BTxD, dropped = run(x, idx, gates, ws)
    if mlp_axes:  # the down projection's partial sums over the expert-MLP shards
      y_BTxD = jax.lax.psum(y_BTxD, mlp_axes)
    return y_BTxD.reshape(b, t, d), dropped.reshape(1)

  run = jax.shard_map(local, in_specs=(act, act, act, w_in, w_in, w_out),
                      out_specs=(act, P(batch_spec)), check_vma=False)
  y, dropped_per_shard = run(x_BxTxD, idx_BxTxEk, gates_BxTxEk, experts.gate_proj[...],
                             experts.up_proj[...], experts.down_proj[...])
  return y, jnp.sum(dropped_per_shard)


def gathered_swiglu(x_BTxD: Array, idx_BTxEk: Array, experts: Experts, dtype) -> Array:
  """[BT, Ek, D] as grouped_swiglu, by gathering each token's Ek experts' weights.

  The decode form for a few tokens (BT Ek <= E, MoE.decode): it reads only the chosen
  experts' weights, as many as grouped_swiglu's block form gathers at least, without its
  sort, padding and scatter."""
  x_BTxD = x_BTxD.astype(dtype)
  wg, wu, wd = (w[...][idx_BTxEk].astype(dtype)  # [BT, Ek, in, out]
                for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
  f32 = jnp.float32
  h_BTxEkxF = (jax.nn.silu(jnp.einsum('nd,nkdf->nkf', x_BTxD, wg, preferred_element_type=f32))
               * jnp.einsum('nd,nkdf->nkf', x_BTxD, wu, preferred_element_type=f32))
  return jnp.einsum('nkf,nkfd->nkd', h_BTxEkxF.astype(dtype), wd,
                    preferred_element_type=f32).astype(dtype)


class MoE(nnx.Module):
  """Shared experts + sigmoid-routed experts; the call signature of layers.MLP."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    self.gate = Router(cfg, rngs)
    self.experts = Experts(cfg, rngs)
    if cfg.n_shared_experts:
      shared = dataclasses.replace(cfg, mlp_dim=cfg.moe_intermediate_size * cfg.n_shared_experts)
      self.shared_experts = layers.MLP(shared, rngs)
    else:
      self.shared_experts = None
    self.num_experts = cfg.n_routed_experts
    self.top_k = cfg.num_experts_per_tok
    self.scaling = cfg.routed_scaling_factor
    self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
    self.dispatch = cfg.moe_dispatch
    self.exchange = cfg.moe_exchange
    self.capacity_factor = cfg.moe_capacity_factor
    self.dtype = cfg.dtype

  @staticmethod
  def flops_per_token(cfg) -> float:
    """Forward FLOPs per token of the active experts only (the router, K routed and the
    shared SwiGLUs): what a token costs, not the parameters it could reach."""
    d, f = cfg.d_model, cfg.moe_intermediate_size
    return float(2 * d * cfg.n_routed_experts
                 + 3 * 2 * d * f * (cfg.num_experts_per_tok + cfg.n_shared_experts))

  def __call__(self, x_BxTxD: Array) -> Array:
    b, t, d = x_BxTxD.shape
    x_BTxD = x_BxTxD.reshape(b * t, d)
    logits_BTxE = jnp.dot(x_BTxD.astype(jnp.float32), self.gate.kernel[...].astype(jnp.float32))
    scores_BTxE = jax.nn.sigmoid(logits_BTxE)
    bias_E = jax.lax.stop_gradient(self.gate.e_score_correction_bias[...])
    idx_BTxEk, gates_BTxEk = route(scores_BTxE, bias_E, self.top_k, self.scaling, self.n_group,
                                   self.topk_group)
    ax = expert_layout()
    if ax is None:
      y_BTxEkxD = grouped_swiglu(x_BTxD, idx_BTxEk, self.experts, self.num_experts, self.dtype,
                                 self.dispatch)
      y_BTxD = jnp.einsum('nk,nkd->nd', gates_BTxEk.astype(self.dtype), y_BTxEkxD)
    else:
      y_BxTxD, dropped = expert_parallel_swiglu(
          x_BxTxD, idx_BTxEk.reshape(b, t, -1), gates_BTxEk.reshape(b, t, -1), self.experts,
          self.dtype, self.dispatch, ax, self.exchange, self.capacity_factor)
      y_BTxD = y_BxTxD.reshape(b * t, d)
      if self.capacity_factor > 0:  # rows past the receive buffers, this layer, all devices
        self.dropped = nnx.Intermediate(dropped.astype(jnp.float32))
    if self.shared_experts is not None:
      y_BTxD = y_BTxD + self.shared_experts(x_BxTxD).reshape(b * t, d)
    self.expert_load = nnx.Intermediate(
        jnp.bincount(idx_BTxEk.reshape(-1), length=self.num_experts).astype(jnp.float32))
    self.balance = nnx.Intermediate(balance_loss(
        scores_BTxE.reshape(b, t, -1), idx_BTxEk.reshape(b, t, -1)))
    return constrain(y_BTxD.reshape(b, t, d).astype(x_BxTxD.dtype),
                     ('batch', 'length', 'act_embed'))

  def prepare_decode(self) -> None:
    """The decode layout (decode_ops.DecodeWeight): the router as gate_t [E, D], the shared
    experts' (layers.MLP.prepare_decode). The routed experts keep their [E, in, out]
    kernels: a decode step gathers the chosen ones per token (gathered_swiglu)."""
    self.gate_t = decode_ops.DecodeWeight(decode_ops.decode_kernel(self.gate.kernel))
    del self.gate.kernel  # the router keeps its routing bias
    if self.shared_experts is not None:
      self.shared_experts.prepare_decode()

  def decode(self, x_BxTxD: Array) -> Array:
    """__call__ for a decode step (prepare_decode's weights), without the load statistics.

    The same routing (`route`, scores in float32); up to E / K tokens gather their experts'
    weights (gathered_swiglu), more (a prefill) go through grouped_swiglu's dispatch.
    """
    b, t, d = x_BxTxD.shape
    x_BTxD = x_BxTxD.reshape(b * t, d)
    scores_BTxE = jax.nn.sigmoid(
        decode_ops.decode_dot(x_BTxD.astype(jnp.float32), self.gate_t[...]))
    idx_BTxEk, gates_BTxEk = route(scores_BTxE, self.gate.e_score_correction_bias[...], self.top_k,
                                   self.scaling, self.n_group, self.topk_group)
    if b * t * self.top_k <= self.num_experts:
      y_BTxEkxD = gathered_swiglu(x_BTxD, idx_BTxEk, self.experts, self.dtype)
    else:
      y_BTxEkxD = grouped_swiglu(x_BTxD, idx_BTxEk, self.experts, self.num_experts, self.dtype,
                                 self.dispatch, backward=False)
    y_BTxD = jnp.einsum('nk,nkd->nd', gates_BTxEk.astype(self.dtype), y_BTxEkxD)
    if self.shared_experts is not None:
      y_BTxD = y_BTxD + self.shared_experts.decode(x_BxTxD).reshape(b * t, d)
    return y_BTxD.reshape(b, t, d).astype(x_BxTxD.dtype)


def moe_modules(model: nnx.Module) -> list[MoE]:
  """The MoE layers of a model, in a fixed (graph traversal) order."""
  return [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]


def collect(model: nnx.Module) -> dict:
  """{'moe_load': [L, E], 'moe_balance': [L]} of the last forward pass, popped off the
  modules ({} for a model without MoE layers); with a capacity factor under the
  all-to-all exchange also 'moe_dropped' [L], the (token, expert) rows each layer dropped."""
  mods = moe_modules(model)
  if not mods:
    return {}
  loads = [m.expert_load[...] for m in mods]
  bal = [m.balance[...] for m in mods]
  out = {'moe_load': jnp.stack(loads), 'moe_balance': jnp.stack(bal)}
  if all(hasattr(m, 'dropped') for m in mods):  # a capacity factor under the exchange
    out['moe_dropped'] = jnp.stack([m.dropped[...] for m in mods])
  nnx.pop(model, nnx.Intermediate)
  return out


def update_bias(model: nnx.Module, load_LxE: Array, rate: float) -> dict:
  """b += rate * sign(mean load - load) per MoE layer (outside the gradient).

  Returns the bias range after the update: {'moe_bias_min': [L], 'moe_bias_max': [L]}.
  """
  mods = moe_modules(model)
  lo, hi = [], []
  for m, load_E in zip(mods, load_LxE):
    var = m.gate.e_score_correction_bias
    var[...] = var[...] + rate * jnp.sign(jnp.mean(load_E) - load_E)
    lo.append(jnp.min(var[...]))
    hi.append(jnp.max(var[...]))
  return {'moe_bias_min': jnp.stack(lo), 'moe_bias_max': jnp.stack(hi)}


def log_metrics(m: dict) -> dict:
  """Per-layer scalars of one step's metrics for metrics.jsonl / TensorBoard ({} if no MoE):
  train/moe_load_max_over_mean_l{j} (1 is perfectly even), train/moe_bias_{min,max}_l{j},
  train/moe_balance_l{j} (L_bal without alpha), train/moe_dropped_rows_l{j} (with a capacity
  factor). j counts MoE layers, the MTP blocks last."""
  if 'moe_load' not in m:
    return {}
  out = {}
  load = jnp.asarray(m['moe_load'])
  ratio = jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9)
  for j in range(load.shape[0]):
    out[f'train/moe_load_max_over_mean_l{j}'] = float(ratio[j])
    out[f'train/moe_balance_l{j}'] = float(m['moe_balance'][j])
    out[f'train/moe_bias_min_l{j}'] = float(m['moe_bias_min'][j])
    out[f'train/moe_bias_max_l{j}'] = float(m['moe_bias_max'][j])
    if 'moe_dropped' in m:
      out[f'train/moe_dropped_rows_l{j}'] = float(m['moe_dropped'][j])
  return out
