"""The expert-parallel exchange of DeepSeekMoE rows (model/moe.py, `model.moe.exchange`).

Inside the expert-parallel jax.shard_map each device holds E / P of the E routed experts
(P: the devices of its expert group, over the expert mesh axes). It sorts its own N K
(token, expert) rows by expert, so that the rows for device p are one contiguous slice,
and sends each row once, to the device that holds its expert:

  counts[q, p, e]  rows device q routes to device p's local expert e (all-gathered: P P E/P
                   integers, the only thing every device learns about the others)
  sent[q, p]       = sum_e counts[q, p, e]
  in_off[q, p]     = sum_{p' < p} sent[q, p']  where device q's slice for p starts
  out_off[q, p]    = sum_{q' < q} sent[q', p]  where it lands in p's receive buffer

The receive buffer holds R rows. Dropless (capacity_factor 0): R = P N min(K, E / P), the
most rows a device can be sent (every token of the group choosing min(K, E / P) of its
experts), so nothing is ever dropped; the buffer is that large but the grouped-matmul
kernel computes only the rows received. With a capacity factor c > 0, R = c N K rounded
up to 8 (the mean a device receives is N K): a slice that would run past R is cut at R,
its last rows (the highest local experts of the latest senders) are dropped, return zero
and are counted. The gated outputs travel back by the reverse exchange (the same slices,
roles swapped).

`ragged_exchange` runs `jax.lax.ragged_all_to_all` on TPU / GPU. XLA:CPU cannot run that
collective, so on CPU (impl 'emulate') the same rows move from the same offset / size
arrays through an all-gather and a gather: exact, differentiable, and P times the bytes,
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
  """R, the receive buffer's rows (module docstring): the worst case when dropless."""
  worst = devices * n_tokens * min(k, local_experts)
  if capacity_factor <= 0:
    return worst
  return min(worst, math.ceil(capacity_factor * n_tokens * k / 8) * 8)


def plan(counts_PxL: Array, all_counts_QxPxL: Array, me: Array, rows: int) -> dict:
  """Offsets and sizes of the forward exchange for device `me` from its own counts
  [P, L] (rows it routes to each device's L local experts) and everyone's [Q=P, P, L];
  `rows` = R. Slices cut at R are accounted in 'dropped' (this device's rows)."""
  sent_QxP = jnp.sum(all_counts_QxPxL, axis=-1)
  out_off_QxP = jnp.cumsum(sent_QxP, axis=0) - sent_QxP
  kept_QxP = jnp.clip(rows - out_off_QxP, 0, sent_QxP)
  out_off_QxP = jnp.minimum(out_off_QxP, rows)
  in_off_QxP = jnp.cumsum(sent_QxP, axis=1) - sent_QxP
  send_P = jnp.sum(counts_PxL, axis=-1)
  return {
      'input_offsets': in_off_QxP[me], 'send_sizes': kept_QxP[me],
      'output_offsets': out_off_QxP[me], 'recv_sizes': kept_QxP[:, me],
      'recv_offsets': out_off_QxP[:, me], 'sender_offsets': in_off_QxP[:, me],
      'dropped': jnp.sum(send_P - kept_QxP[me]),
  }


def ragged_exchange(operand_NKxD: Array, output_RxD: Array, input_offsets: Array,
                    send_sizes: Array, output_offsets: Array, recv_sizes: Array, axes,
                    impl: str) -> Array:
  """jax.lax.ragged_all_to_all over the mesh axes `axes` (inside shard_map), or its CPU
  emulation (impl 'emulate'): the same rows to the same places."""
  if impl == 'collective':
    return jax.lax.ragged_all_to_all(operand_NKxD, output_RxD, input_offsets, send_sizes,
                                     output_offsets, recv_sizes, axis_name=axes)
  me = jax.lax.axis_index(axes)
  src_QxNKxD = jax.lax.all_gather(operand_NKxD, axes)
  in_off_QxP, sizes_QxP, out_off_QxP = (jax.lax.all_gather(a, axes) for a in
                                        (input_offsets, send_sizes, output_offsets))
  start_Q, size_Q, src_Q = out_off_QxP[:, me], sizes_QxP[:, me], in_off_QxP[:, me]
  r_R = jnp.arange(output_RxD.shape[0])
  inside_RxQ = (r_R[:, None] >= start_Q) & (r_R[:, None] < start_Q + size_Q)
  q_R = jnp.argmax(inside_RxQ, axis=1)
  row_R = jnp.clip(src_Q[q_R] + r_R - start_Q[q_R], 0, operand_NKxD.shape[0] - 1)
  return jnp.where(jnp.any(inside_RxQ, axis=1)[:, None], src_QxNKxD[q_R, row_R], output_RxD)


def received_experts(p: dict, counts_QxL: Array, rows: int) -> Array:
  """[R]: the local expert of each receive-buffer row (L for rows nothing landed in);
  counts_QxL: the rows each sender routes to this device's experts."""
  r_R = jnp.arange(rows)
  start_Q, size_Q = p['recv_offsets'], p['recv_sizes']
  inside_RxQ = (r_R[:, None] >= start_Q) & (r_R[:, None] < start_Q + size_Q)
  q_R = jnp.argmax(inside_RxQ, axis=1)
  i_R = r_R - start_Q[q_R]
  ends_QxL = jnp.cumsum(counts_QxL, axis=-1)
  e_R = jnp.sum(i_R[:, None] >= ends_QxL[q_R], axis=-1)
  return jnp.where(jnp.any(inside_RxQ, axis=1), e_R, counts_QxL.shape[-1])
