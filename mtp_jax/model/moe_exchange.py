"""The expert-parallel exchange of DeepSeekMoE rows (model/moe.py, `model.moe.exchange`).

Inside the expert-parallel jax.shard_map each device holds Ed = E / X of the E routed
experts (X: the devices of its expert group, over the expert mesh axes). It sorts its own
BT Ek (token, expert) rows by expert, so that the rows for device x are one contiguous
slice, and sends each row once, to the device that holds its expert:

  counts[xs, x, e]  rows device xs routes to device x's local expert e (all-gathered: X X Ed
                    integers, the only thing every device learns about the others)
  sent[xs, x]       = sum_e counts[xs, x, e]
  in_off[xs, x]     = sum_{x' < x} sent[xs, x']  where device xs's slice for x starts
  out_off[xs, x]    = sum_{xs' < xs} sent[xs', x]  where it lands in x's receive buffer

Every slice moves in whole blocks of BLOCK_ROWS rows (plan): the offsets above are taken
over the slices rounded up to blocks, and the buffers hold the padding (padded_rows).
The receive buffer keeps R real rows. Dropless (capacity_factor 0): R = X BT min(Ek, Ed),
the most rows a device can be sent (every token of the group choosing min(Ek, Ed) of its
experts), so nothing is ever dropped; the buffer is that large but the grouped-matmul
kernel computes only the rows received. With a capacity factor c > 0, R = c BT Ek rounded
up to 8 (the mean a device receives is BT Ek): receiver x takes the senders' slices in
the order x, x + 1, ... (mod X), a slice that would run past R is cut there, and its last
rows (the highest local experts of the senders last in x's order) are dropped, return
zero and are counted; as each receiver starts from a different sender, the rows cut come
from different data shards. The gated outputs travel back by the reverse exchange (the
same slices, roles swapped), which also carries the gradients back (`exchange`). Neither
exchange zero-fills its receive buffer (jax.lax.empty): rows nothing lands in are never
read as values. Shape suffixes: Xs a device as the sender, X as the receiver.

`ragged_exchange` runs `jax.lax.ragged_all_to_all` on TPU / GPU. XLA:CPU cannot run that
collective, so on CPU (impl 'emulate') the same rows move from the same offset / size
arrays through an all-gather and a gather: exact, differentiable, and X times the bytes,
which is why it is CPU-only.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import kinds

Array = jax.Array

EXCHANGES = kinds.MOE_EXCHANGES  # model.moe.exchange's names (config/kinds.py)
# Rows move in blocks of this many: a bfloat16 row block of a TPU tile is 16 rows, and a
# collective whose slices start and end on tiles moves them where they are, where
# row-granular slices make the compiler change the buffers' layout around it (copies).
BLOCK_ROWS = 16


def exchange_impl() -> str:
  """'collective' (ragged_all_to_all) where the backend runs it, 'emulate' on CPU."""
  return 'emulate' if jax.default_backend() == 'cpu' else 'collective'


def buffer_rows(n_tokens: int, k: int, devices: int, local_experts: int,
                capacity_factor: float) -> int:
  """R, the real rows a device's receive buffer keeps (module docstring): the worst case
  when dropless. The buffer itself has padded_rows(R, X) rows."""
  worst = devices * n_tokens * min(k, local_experts)
  if capacity_factor <= 0:
    return worst
  return min(worst, math.ceil(capacity_factor * n_tokens * k / 8) * 8)


def padded_rows(rows: int, devices: int, block: int = BLOCK_ROWS) -> int:
  """The rows of a buffer that holds `rows` real rows in `devices` slices that each start
  and end on a multiple of `block` (a slice's padding: up to block - 1 rows)."""
  return _round_up(rows + devices * (block - 1), block)


def _round_up(a, m: int):
  return (a + m - 1) // m * m


def plan(counts_XxEd: Array, all_counts_XsxXxEd: Array, me: Array, rows: int,
         block: int = BLOCK_ROWS) -> dict:
  """Offsets and sizes of the forward exchange for device `me` from its own counts
  [X, Ed] (rows it routes to each device's Ed local experts) and everyone's [Xs, X, Ed];
  `rows` = R real rows kept per receiver. Rows past R are accounted in 'dropped' (this
  device's rows).

  Receiver x takes the senders' rows in the order x, x + 1, ... (mod X): where more than R
  arrive, the rows cut are those of the sender just before x, a different sender for every
  receiver, so no data shard always loses its rows. Every slice moves in whole blocks of
  `block` rows: it starts on a block in both buffers, and its last block is filled up with
  padding rows that nothing reads. The collective's offsets and sizes are in rows
  ('input_offsets', 'send_sizes', 'output_offsets', 'recv_sizes'; 'recv_offsets' and
  'sender_offsets' for the reverse exchange); 'kept' [X] and 'received' [Xs] count the
  real rows of the slices this device sends and receives, 'first' [X] is where the rows
  for each device start among its rows sorted by destination."""
  sent_XsxX = jnp.sum(all_counts_XsxXxEd, axis=-1)
  n = sent_XsxX.shape[0]
  # rank_XsxX[xs, x] = (xs - x) mod X: sender xs's place in receiver x's filling order
  rank_XsxX = (jnp.arange(n)[:, None] - jnp.arange(n)[None, :]) % n
  sender_JxX = (jnp.arange(n)[:, None] + jnp.arange(n)[None, :]) % n  # the j-th, for x

  def ahead(a_XsxX):  # for each (xs, x): the sum of a over the senders before xs, for x
    in_order_JxX = jnp.take_along_axis(a_XsxX, sender_JxX, axis=0)
    before_JxX = jnp.cumsum(in_order_JxX, axis=0) - in_order_JxX
    return jnp.take_along_axis(before_JxX, rank_XsxX, axis=0)

  kept_XsxX = jnp.clip(rows - ahead(sent_XsxX), 0, sent_XsxX)
  moved_XsxX = _round_up(kept_XsxX, block)
  out_off_XsxX = ahead(moved_XsxX)
  room_XsxX = _round_up(sent_XsxX, block)  # the send buffer: each destination's rows padded
  in_off_XsxX = jnp.cumsum(room_XsxX, axis=1) - room_XsxX
  send_X = jnp.sum(counts_XxEd, axis=-1)
  return {
      'input_offsets': in_off_XsxX[me], 'send_sizes': moved_XsxX[me],
      'output_offsets': out_off_XsxX[me], 'recv_sizes': moved_XsxX[:, me],
      'recv_offsets': out_off_XsxX[:, me], 'sender_offsets': in_off_XsxX[:, me],
      'kept': kept_XsxX[me], 'received': kept_XsxX[:, me],
      'first': jnp.cumsum(send_X) - send_X,
      'dropped': jnp.sum(send_X - kept_XsxX[me]),
  }


def send_slots(p: dict, dest_N: Array) -> Array:
  """[N]: the send-buffer row of each of this device's N rows sorted by destination
  (dest_N: each one's device)."""
  return p['input_offsets'][dest_N] + jnp.arange(dest_N.shape[0]) - p['first'][dest_N]


def slot_sources(slots_N: Array, size: int) -> Array:
  """[size]: for each buffer row, which of the N rows sits there (slots_N: each row's
  buffer row); 0 for a padding row (take_rows' `inverse` for a buffer made by slots_N)."""
  n = slots_N.shape[0]
  return jnp.zeros((size,), slots_N.dtype).at[slots_N].set(jnp.arange(n, dtype=slots_N.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def token_rows(x_BTxD: Array, token_S: Array, slots_BTxEk: Array, sent_BTxEk, dtype) -> Array:
  """The send buffer [S, D] in `dtype`: row s is token token_S[s]'s row (padding rows: any
  token). Its gradient for token t is the sum of the rows in its Ek slots slots_BTxEk[t]
  (Ek gathers, no scatter; the padding rows' cotangents are never read), over the slots
  the exchange sent (sent_BTxEk; None: all): a row it dropped gets no defined gradient
  from the exchange."""
  del slots_BTxEk, sent_BTxEk
  return x_BTxD[token_S].astype(dtype)


def _token_rows_fwd(x_BTxD, token_S, slots_BTxEk, sent_BTxEk, dtype):
  out = token_rows(x_BTxD, token_S, slots_BTxEk, sent_BTxEk, dtype)
  return out, (token_S, slots_BTxEk, sent_BTxEk, jnp.zeros((0,), x_BTxD.dtype))


def _token_rows_bwd(dtype, res, ct_SxD):
  del dtype
  token_S, slots_BTxEk, sent_BTxEk, x_kind = res  # x_kind: x's dtype, no elements
  grad = 0.0
  for j in range(slots_BTxEk.shape[1]):  # float32 sums, as a matmul accumulates
    term = ct_SxD[slots_BTxEk[:, j]].astype(jnp.float32)
    if sent_BTxEk is not None:
      term = jnp.where(sent_BTxEk[:, j:j + 1], term, 0.0)
    grad = grad + term
  zero = lambda a: None if a is None else np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return grad.astype(x_kind.dtype), zero(token_S), zero(slots_BTxEk), zero(sent_BTxEk)


token_rows.defvjp(_token_rows_fwd, _token_rows_bwd)


def sent_rows(p: dict, dest_N: Array) -> Array:
  """[N] bool: which of this device's rows (sorted by destination, dest_N each one's
  device) the forward exchange keeps; the others are dropped."""
  return jnp.arange(dest_N.shape[0]) - p['first'][dest_N] < p['kept'][dest_N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def exchange(rows: int, axes, impl: str, operand: Array, there: tuple, back: tuple) -> Array:
  """operand's slices moved by ragged_exchange as `there` (input_offsets, send_sizes,
  output_offsets, recv_sizes) says, into a [rows, ...] buffer that is not initialised
  first (_buffer: no fill pass; its rows nothing lands in hold whatever was there,
  zero on CPU). `back` is the reverse exchange, which moves the gradient (the same
  slices, roles swapped): its rows of `operand` that were not sent get no defined
  gradient either, so a caller whose rows can be dropped masks them."""
  return ragged_exchange(operand, _buffer(rows, operand), *there, axes, impl)


def _buffer(rows: int, operand: Array) -> Array:
  """An uninitialised [rows, ...] receive buffer made inside the layer it serves.

  jax.lax.empty has no inputs, so when the exchange runs in the body of a scan over layers
  (model.scan_layers) and is differentiated, JAX's partial evaluation hoists it out of the
  loop as a loop invariant; the collective writes its buffer in place, so the compiled
  loop then copies the hoisted buffer on every iteration (on TPU a full read and write of
  it per layer). Chosen by a condition on one element of the rows being sent (both
  branches the same), the buffer depends on the layer's data and is allocated where it is
  used, once those rows exist, which keeps its lifetime short."""
  shape = (rows,) + operand.shape[1:]
  make = lambda: jax.lax.empty(shape, operand.dtype)  # noqa: E731
  first = operand.ravel()[0]
  return jax.lax.cond(first == first, make, make)  # true unless NaN; either way the same


def _exchange_fwd(rows, axes, impl, operand, there, back):
  return exchange(rows, axes, impl, operand, there, back), (operand.shape[0], there, back)


def _exchange_bwd(rows, axes, impl, res, ct):
  del rows
  n, there, back = res
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), (there, back))
  return (exchange(n, axes, impl, ct, back, there),) + zeros


exchange.defvjp(_exchange_fwd, _exchange_bwd)


def inverse_permutation(order: Array) -> Array:
  """inv with inv[order[i]] = i."""
  return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


@jax.custom_vjp
def take_rows(x: Array, order: Array, inverse: Array) -> Array:
  """x[order], where `order` picks each of x's rows at most once and inverse[r] is where
  x's row r landed: its gradient is the gather ct[inverse], not a scatter into a
  zero-filled buffer. A row of x that `order` does not pick (padding) gets whichever row
  its `inverse` entry names: callers use that only where nothing reads those rows."""
  return x[order]


def _take_rows_fwd(x, order, inverse):
  return x[order], (order, inverse)


def _take_rows_bwd(res, ct):
  order, inverse = res
  zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
  return ct[inverse], zero(order), zero(inverse)


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def ragged_exchange(operand_BTEkxD: Array, output_YxD: Array, input_offsets: Array,
                    send_sizes: Array, output_offsets: Array, recv_sizes: Array, axes,
                    impl: str) -> Array:
  """jax.lax.ragged_all_to_all over the mesh axes `axes` (inside shard_map), or its CPU
  emulation (impl 'emulate'): the same rows to the same places."""
  if impl == 'collective':  # in blocks of BLOCK_ROWS rows: plan's offsets, sizes are whole blocks
    blocks = lambda a: a.reshape((a.shape[0] // BLOCK_ROWS, BLOCK_ROWS) + a.shape[1:])  # noqa: E731
    out = jax.lax.ragged_all_to_all(
        blocks(operand_BTEkxD), blocks(output_YxD),
        *(a // BLOCK_ROWS for a in (input_offsets, send_sizes, output_offsets, recv_sizes)),
        axis_name=axes)
    return out.reshape(output_YxD.shape)
  me = jax.lax.axis_index(axes)
  src_XsxBTEkxD = jax.lax.all_gather(operand_BTEkxD, axes)
  in_off_XsxX, sizes_XsxX, out_off_XsxX = (jax.lax.all_gather(a, axes) for a in
                                           (input_offsets, send_sizes, output_offsets))
  start_Xs, size_Xs, src_Xs = out_off_XsxX[:, me], sizes_XsxX[:, me], in_off_XsxX[:, me]
  r_Y = jnp.arange(output_YxD.shape[0])
  inside_YxXs = (r_Y[:, None] >= start_Xs) & (r_Y[:, None] < start_Xs + size_Xs)
  q_Y = jnp.argmax(inside_YxXs, axis=1)
  row_Y = jnp.clip(src_Xs[q_Y] + r_Y - start_Xs[q_Y], 0, operand_BTEkxD.shape[0] - 1)
  return jnp.where(jnp.any(inside_YxXs, axis=1)[:, None], src_XsxBTEkxD[q_Y, row_Y], output_YxD)


def received_experts(p: dict, counts_XsxEd: Array, rows: int) -> Array:
  """[rows]: the local expert of each receive-buffer row (Ed for rows nothing landed in
  and for padding); counts_XsxEd: the rows each sender routes to this device's experts."""
  r_Y = jnp.arange(rows)
  start_Xs, size_Xs = p['recv_offsets'], p['received']
  inside_YxXs = (r_Y[:, None] >= start_Xs) & (r_Y[:, None] < start_Xs + size_Xs)
  q_Y = jnp.argmax(inside_YxXs, axis=1)
  i_Y = r_Y - start_Xs[q_Y]
  ends_XsxEd = jnp.cumsum(counts_XsxEd, axis=-1)
  e_Y = jnp.sum(i_Y[:, None] >= ends_XsxEd[q_Y], axis=-1)
  return jnp.where(jnp.any(inside_YxXs, axis=1), e_Y, counts_XsxEd.shape[-1])
