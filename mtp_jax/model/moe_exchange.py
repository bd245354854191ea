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

The receive buffer holds Y rows. Dropless (capacity_factor 0): Y = X BT min(Ek, Ed), the
most rows a device can be sent (every token of the group choosing min(Ek, Ed) of its
experts), so nothing is ever dropped; the buffer is that large but the grouped-matmul
kernel computes only the rows received. With a capacity factor c > 0, Y = c BT Ek rounded
up to 8 (the mean a device receives is BT Ek): a slice that would run past Y is cut at Y,
its last rows (the highest local experts of the latest senders) are dropped, return zero
and are counted. The gated outputs travel back by the reverse exchange (the same slices,
roles swapped). Shape suffixes: Xs a device as the sender, X as the receiver.

`ragged_exchange` runs `jax.lax.ragged_all_to_all` on TPU / GPU. XLA:CPU cannot run that
collective, so on CPU (impl 'emulate') the same rows move from the same offset / size
arrays through an all-gather and a gather: exact, differentiable, and X times the bytes,
which is why it is CPU-only.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array

EXCHANGES = ('all_to_all', 'all_gather')


def exchange_impl() -> str:
  """'collective' (ragged_all_to_all) where the backend runs it, 'emulate' on CPU."""
  return 'emulate' if jax.default_backend() == 'cpu' else 'collective'


def buffer_rows(n_tokens: int, k: int, devices: int, local_experts: int,
                capacity_factor: float) -> int:
  """Y, the receive buffer's rows (module docstring): the worst case when dropless."""
  worst = devices * n_tokens * min(k, local_experts)
  if capacity_factor <= 0:
    return worst
  return min(worst, math.ceil(capacity_factor * n_tokens * k / 8) * 8)


def plan(counts_XxEd: Array, all_counts_XsxXxEd: Array, me: Array, rows: int) -> dict:
  """Offsets and sizes of the forward exchange for device `me` from its own counts
  [X, Ed] (rows it routes to each device's Ed local experts) and everyone's [Xs, X, Ed];
  `rows` = Y. Slices cut at Y are accounted in 'dropped' (this device's rows)."""
  sent_XsxX = jnp.sum(all_counts_XsxXxEd, axis=-1)
  out_off_XsxX = jnp.cumsum(sent_XsxX, axis=0) - sent_XsxX
  kept_XsxX = jnp.clip(rows - out_off_XsxX, 0, sent_XsxX)
  out_off_XsxX = jnp.minimum(out_off_XsxX, rows)
  in_off_XsxX = jnp.cumsum(sent_XsxX, axis=1) - sent_XsxX
  send_X = jnp.sum(counts_XxEd, axis=-1)
  return {
      'input_offsets': in_off_XsxX[me], 'send_sizes': kept_XsxX[me],
      'output_offsets': out_off_XsxX[me], 'recv_sizes': kept_XsxX[:, me],
      'recv_offsets': out_off_XsxX[:, me], 'sender_offsets': in_off_XsxX[:, me],
      'dropped': jnp.sum(send_X - kept_XsxX[me]),
  }


def ragged_exchange(operand_BTEkxD: Array, output_YxD: Array, input_offsets: Array,
                    send_sizes: Array, output_offsets: Array, recv_sizes: Array, axes,
                    impl: str) -> Array:
  """jax.lax.ragged_all_to_all over the mesh axes `axes` (inside shard_map), or its CPU
  emulation (impl 'emulate'): the same rows to the same places."""
  if impl == 'collective':
    return jax.lax.ragged_all_to_all(operand_BTEkxD, output_YxD, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axes)
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
  """[Y]: the local expert of each receive-buffer row (Ed for rows nothing landed in);
  counts_XsxEd: the rows each sender routes to this device's experts."""
  r_Y = jnp.arange(rows)
  start_Xs, size_Xs = p['recv_offsets'], p['recv_sizes']
  inside_YxXs = (r_Y[:, None] >= start_Xs) & (r_Y[:, None] < start_Xs + size_Xs)
  q_Y = jnp.argmax(inside_YxXs, axis=1)
  i_Y = r_Y - start_Xs[q_Y]
  ends_XsxEd = jnp.cumsum(counts_XsxEd, axis=-1)
  e_Y = jnp.sum(i_Y[:, None] >= ends_XsxEd[q_Y], axis=-1)
  return jnp.where(jnp.any(inside_YxXs, axis=1), e_Y, counts_XsxEd.shape[-1])
