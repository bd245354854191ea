"""The TPU compiler flags every TPU program of this project is compiled with.

libtpu reads LIBTPU_INIT_ARGS once, when the TPU backend (or the compile-only topology)
is created, so `apply()` must run before that: the trainer calls it right after parsing its
flags (scripts/train.py, and so every host the pod launcher starts), the AOT tool before it
creates the topology. Standard library only, so it can run before JAX is imported.

The flags let the TPU compiler run collectives asynchronously and overlap them with the
compute around them (what MaxText sets for v5p / v6e training, its "continuation fusion"
and data-parallel overlap groups); docs/scaling.md shows each one's effect on the
compiler's own price of a step:

  xla_tpu_enable_async_collective_fusion (+ _fuse_all_gather, _multiple_steps)
      a collective becomes an asynchronous fusion whose steps interleave with compute
  xla_tpu_overlap_compute_collective_tc      the TensorCore computes while it runs
  xla_enable_async_all_gather / _all_reduce  start/done pairs the scheduler can move apart
  xla_tpu_enable_data_parallel_all_reduce_opt, xla_tpu_data_parallel_opt_different_sized_ops
      the gradient all-reduces of data parallelism pipelined with the backward pass

A flag the user already put in LIBTPU_INIT_ARGS keeps the user's value (set
`--xla_tpu_enable_async_collective_fusion=false` there to compile without it), and
MTP_JAX_TPU_FLAGS=0 leaves LIBTPU_INIT_ARGS untouched. Other backends ignore the variable.
"""
from __future__ import annotations

import os

ENV = 'LIBTPU_INIT_ARGS'
SWITCH = 'MTP_JAX_TPU_FLAGS'

FLAGS = (
    '--xla_tpu_enable_async_collective_fusion=true',
    '--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true',
    '--xla_tpu_enable_async_collective_fusion_multiple_steps=true',
    '--xla_tpu_overlap_compute_collective_tc=true',
    '--xla_enable_async_all_gather=true',
    '--xla_enable_async_all_reduce=true',
    '--xla_tpu_enable_data_parallel_all_reduce_opt=true',
    '--xla_tpu_data_parallel_opt_different_sized_ops=true',
)


def _name(flag: str) -> str:
  return flag.split('=', 1)[0].lstrip('-')


def merged(existing: str, flags=FLAGS) -> str:
  """`existing` (LIBTPU_INIT_ARGS) with each of `flags` appended unless it names it."""
  have = {_name(f) for f in existing.split()}
  extra = [f for f in flags if _name(f) not in have]
  return ' '.join(existing.split() + extra)


def apply(environ=None) -> str:
  """Puts FLAGS into LIBTPU_INIT_ARGS (the user's own values win) unless MTP_JAX_TPU_FLAGS
  is 0; returns the resulting value. Call before the TPU backend initialises."""
  environ = os.environ if environ is None else environ
  if environ.get(SWITCH, '1').strip().lower() in ('0', 'false', 'no', 'off'):
    return environ.get(ENV, '')
  environ[ENV] = merged(environ.get(ENV, ''))
  return environ[ENV]
