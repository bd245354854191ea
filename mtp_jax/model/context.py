"""Context parallelism: every sequence split over the mesh axes of the `length` rule
(`context`), in a load-balanced order, with MTP's shifts taken in the natural order.

Causal attention over contiguous chunks is unbalanced: the shard holding the last chunk
sees every key, the first only its own. With n shards the sequence is cut into 2n chunks
and shard i holds chunks i and 2n-1-i (`balanced_order`), so every shard does the same
attention work. The training / evaluation program takes its batch in the natural order,
permutes every [B, T] input (tokens, segment ids, positions) into that layout once
(`in_balanced_layout`), and runs the whole step in it: everything position-wise (blocks,
heads, losses, per-depth sums) is unchanged by the permutation, RoPE reads the permuted
positions, and attention masks come from each token's natural index and segment id.

What is not position-wise is a shift: depth k of the MTP modules reads token t_(i+a_k)
and is scored on t_(i+o_k), packed documents cut those shifts at their boundaries, and
those tokens may live on another shard. `Layout.shift_left` takes the shift in the natural
order (a gather by a static index table: for [B, T] token / segment arrays a few bytes a
token), so a sharded step computes exactly what the unsharded one does.

Decoding never enters the layout: it runs without it, on its own caches.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import spmd as flax_spmd

from mtp_jax.runtime import sharding

Array = jax.Array

_LAYOUT = contextvars.ContextVar('mtp_jax_context_layout', default=None)


def balanced_order(length: int, ways: int) -> np.ndarray:
  """order[j]: the natural index of the token at layout position j. The sequence is cut
  into 2 x ways chunks; shard i (layout positions [i T/ways, (i+1) T/ways)) holds chunk i
  then chunk 2 ways - 1 - i."""
  if ways == 1:
    return np.arange(length, dtype=np.int32)
  chunk = length // (2 * ways)
  chunks = np.arange(length, dtype=np.int32).reshape(2 * ways, chunk)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * ways - 1 - i]])
                         for i in range(ways)])


def length_axes() -> tuple[str, ...]:
  """The mesh axes the active rules shard `length` over (() outside a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not flax_spmd.get_logical_axis_rules():
    return ()
  spec = sharding.logical_spec(('length',))[0]
  if spec is None:
    return ()
  axes = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
  return tuple(a for a in axes if mesh.shape[a] > 1)


class Layout:
  """The balanced order of sequences of `length` tokens over `axes` (`ways` shards)."""

  def __init__(self, length: int, axes: tuple[str, ...], ways: int):
    if length % (2 * ways):
      raise ValueError(f'context parallelism over {ways} shards needs a sequence length '
                       f'divisible by {2 * ways}, got {length}')
    self.length, self.axes, self.ways = length, axes, ways
    self.order = balanced_order(length, ways)
    self.inverse = np.argsort(self.order).astype(np.int32)

  def to_layout(self, x: Array) -> Array:
    """x [B, T, ...] in the natural order -> the balanced layout."""
    return jnp.take(x, jnp.asarray(self.order), axis=1)

  def to_natural(self, x: Array) -> Array:
    return jnp.take(x, jnp.asarray(self.inverse), axis=1)

  def _shift_table(self, k: int) -> tuple[np.ndarray, np.ndarray]:
    source = self.order.astype(np.int64) + k  # the natural index each position reads
    inside = source < self.length
    return (np.where(inside, self.inverse[np.minimum(source, self.length - 1)], 0)
            .astype(np.int32), inside)

  def shift_left(self, x: Array, k: int, fill=0) -> Array:
    """model.mtp.shift_left in the natural order, on x [B, T, ...] in the layout: the value
    of natural position i + k at the position holding i; `fill` past the end."""
    index, inside = self._shift_table(k)
    out = jnp.take(x, jnp.asarray(index), axis=1)
    keep = jnp.asarray(inside).reshape((1, -1) + (1,) * (x.ndim - 2))
    return jnp.where(keep, out, jnp.asarray(fill, x.dtype))


def active() -> Layout | None:
  """The balanced layout the running program's activations are in, or None."""
  return _LAYOUT.get()


@contextlib.contextmanager
def balanced(length: int):
  """Within it, activations of sequences of `length` tokens are in the balanced layout
  over the mesh axes of the `length` rule, when those hold more than one device."""
  axes = length_axes()
  ways = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes) if axes else 1
  token = _LAYOUT.set(Layout(length, axes, ways) if ways > 1 else None)
  try:
    yield _LAYOUT.get()
  finally:
    _LAYOUT.reset(token)


def layout_batch(batch: dict, layout: Layout) -> dict:
  """The [B, T, ...] entries of a natural-order batch in the layout, with explicit positions
  (0..T-1 where the batch has none)."""
  tokens = batch['tokens']
  b, t = tokens.shape[:2]
  out = dict(batch)
  if out.get('positions') is None:
    out['positions'] = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  for name, x in out.items():
    if hasattr(x, 'shape') and x.ndim >= 2 and x.shape[:2] == (b, t):
      out[name] = layout.to_layout(x)
  return out


def in_balanced_layout(fn):
  """fn(model, batch, ...) run with its batch (natural order) in the balanced layout, under
  a mesh whose `length` axes hold more than one device; otherwise fn itself."""
  @functools.wraps(fn)
  def wrapped(model, batch, *args, **kwargs):
    with balanced(batch['tokens'].shape[1]) as layout:
      if layout is None:
        return fn(model, batch, *args, **kwargs)
      return fn(model, layout_batch(batch, layout), *args, **kwargs)
  return wrapped
