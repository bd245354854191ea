"""Checkpoint integrity: a fingerprint of the state and a hash of the data-iterator state.

Orbax restores a checkpoint whose array bytes were flipped without complaint (compressed
chunks are not checksummed), so every save records both in its JSON meta and every
restore checks them.
"""
from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils


def _as_uint32(x):
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


@jax.jit
def _leaf_hashes(leaves):
  """One uint32 per array: a position-dependent mix of its bits, summed (order-free, exact)."""
  out = []
  for x in leaves:
    u = _as_uint32(jnp.asarray(x))
    idx = jnp.zeros(u.shape, jnp.uint32)  # flat index without reshaping a sharded array
    stride = 1
    for axis in reversed(range(u.ndim)):
      idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, axis) * jnp.uint32(stride)
      stride *= u.shape[axis]
    h = (u ^ (idx * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    out.append(jnp.sum(h, dtype=jnp.uint32))
  return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def fingerprint(state) -> list[int]:
  """A uint32 per leaf of `state`; recorded in meta at save, compared at restore."""
  return [int(v) for v in np.asarray(jax.device_get(_leaf_hashes(jax.tree.leaves(state))))]


def data_state_hash(data_iter) -> str | None:
  if data_iter is None or not hasattr(data_iter, 'get_state'):
    return None
  state = data_iter.get_state()
  blob = state if isinstance(state, bytes) else json.dumps(state, sort_keys=True).encode()
  return hashlib.sha256(blob).hexdigest()


def _per_process_hashes(digest: str | None) -> list[str] | None:
  """Every process's data-state digest, in process order (meta is written by process 0)."""
  if digest is None:
    return None
  if jax.process_count() == 1:
    return [digest]
  mine = np.frombuffer(bytes.fromhex(digest), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  return [bytes(row).hex() for row in every.reshape(jax.process_count(), -1)]


def integrity_meta(state, data_iter=None) -> dict:
  return {'fingerprint': fingerprint(state),
          'data_sha256': _per_process_hashes(data_state_hash(data_iter))}


def verify(step: int, state, meta: dict, data_iter=None) -> None:
  """ValueError when the restored state or data position differs from what was saved."""
  want = meta.get('fingerprint')
  if want is not None:
    got = fingerprint(state)
    if got != want:
      bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
      paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
      names = ', '.join(paths[i] for i in bad[:3]) if len(got) == len(want) else 'tree shape'
      raise ValueError(f'step {step}: restored arrays differ from the saved ones '
                       f'({len(bad) or "all"} corrupted, e.g. {names})')
  want_data = meta.get('data_sha256')
  if isinstance(want_data, list):  # one digest per process
    want_data = want_data[jax.process_index()] if len(want_data) == jax.process_count() else None
  if want_data is not None and data_iter is not None and data_state_hash(data_iter) != want_data:
    raise ValueError(f'step {step}: restored data-iterator state differs from the saved one')
