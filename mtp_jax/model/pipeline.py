"""Pipeline parallelism of the trunk's blocks over the 'stage' mesh axis.

The trunk's L layers (after a leading run of another block structure, such as the dense
first layers of a DeepSeekMoE trunk, which runs before the pipeline on every stage) are cut
into S stages of L / S consecutive layers, and the batch into N microbatches. The schedule
is GPipe's, written as one SPMD program (the form MaxText's pipeline takes): the stages'
parameters are stacked to [S, L / S, ...] with the stage axis sharded over 'stage', a
buffer [S, b, T, D] holds what each stage works on, and each of the N + S - 1 iterations
runs every stage once (jax.vmap over the stage axis, each stage on its own devices) and
then shifts the buffer one stage on (a collective permute); stage 0 takes the next
microbatch. Stage s works on microbatch t - s at iteration t, so the last stage emits
microbatch m at iteration m + S - 1. The bubble (stage iterations that do no work) is

  (S - 1) / (N + S - 1)

of the pipeline's time, forward and backward alike (jax.grad of the scan runs the same
schedule in reverse). The idle slots compute on stale buffers whose results are never
read, so they change nothing: the pipelined trunk is the same function as the unpipelined
one, its values and gradients equal up to the order of float additions.

Inside a stage the layers run as the unpipelined trunk runs them (`run`: remat policy,
scan_layers, the data / fsdp / tensor shardings of the active rules); MoE statistics are
summed over the microbatches a stage really worked on (the balance term averaged over
them, as one batch's mean) and go back onto each layer. Everything outside the trunk (the
embedding, the MTP modules, the output head and the loss) is left to the caller: under
the default rules it is replicated over 'stage', on every stage (see docs/scaling.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import PartitionSpec as P

from mtp_jax.runtime.sharding import logical_spec

Array = jax.Array
STAGE_AXIS = 'stage'  # the mesh axis the stages are spread over (MaxText's name)
# MoE statistics that are a mean over the batch's rows (moe.MoE.balance); the others
# (expert loads, dropped rows) are counts and add up over microbatches.
_MEAN_STATS = ('balance',)


def bubble_fraction(stages: int, microbatches: int) -> float:
  """The share of stage iterations that idle in the schedule: (S - 1) / (N + S - 1)."""
  return (stages - 1) / (microbatches + stages - 1)


def split_stages(blocks) -> tuple[list, list]:
  """(prefix, staged): the leading blocks whose structure (graphdef) differs from the last
  block's, run before the pipeline, and the rest, which the stages share out."""
  last = nnx.graphdef(blocks[-1])
  first = 0
  while first < len(blocks) and nnx.graphdef(blocks[first]) != last:
    first += 1
  return list(blocks[:first]), list(blocks[first:])


def staged_layer_count(n_layers: int, first_k_dense: int, mlp: str) -> int:
  """How many trunk layers the stages share out (split_stages, from the model's sizes):
  all of them, or those after the dense first layers of an MoE trunk."""
  return n_layers - min(first_k_dense, n_layers) if mlp == 'moe' else n_layers


def _split_micro(x, n: int):
  """[B, ...] -> [N, B / N, ...], rows j N + m into microbatch m (each microbatch keeps the
  batch's shards on their devices, as train/steps.py's grad accumulation splits)."""
  b = x.shape[0]
  return x.reshape((b // n, n) + x.shape[1:]).swapaxes(0, 1)


def _merge_micro(x):
  """_split_micro's inverse: [N, B / N, ...] -> [B, ...]."""
  return x.swapaxes(0, 1).reshape((-1,) + x.shape[2:])


def _staged_mesh() -> bool:
  """Whether the active mesh has a 'stage' axis (and rules are bound): then the stage axis
  of the stacked parameters and of the buffer is sharded over it."""
  mesh = jax.sharding.get_abstract_mesh()
  return (not mesh.empty and STAGE_AXIS in mesh.axis_names
          and bool(flax_spmd.get_logical_axis_rules()))


def _stage_constrain(x, names):
  """x [S, ...] with its stage axis over 'stage' and the rest by the logical `names`."""
  if not _staged_mesh():
    return x
  return jax.lax.with_sharding_constraint(x, P(STAGE_AXIS, *logical_spec(names)))


def _stacked_params(blocks, stages: int):
  """The blocks' state stacked [S, L / S, ...], stage axis over 'stage', each leaf's other
  axes sharded as the unstacked parameter is (its logical names)."""
  per_stage = len(blocks) // stages

  def stack(*vs):
    v = vs[0]
    value = jnp.stack([u[...] for u in vs])
    value = value.reshape((stages, per_stage) + value.shape[1:])
    names = v.get_metadata().get('out_sharding') or (None,) * (value.ndim - 2)
    return v.replace(_stage_constrain(value, (None,) + tuple(names)))

  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  return jax.tree.map(stack, *[nnx.state(b) for b in blocks], is_leaf=is_var)


def run_stages(blocks, x_BxTxD: Array, positions_BxT: Array, mask, stages: int,
               microbatches: int, run) -> Array:
  """x through `blocks` as `run(blocks, x, positions, mask)` would take it, pipelined over
  `stages` stages and `microbatches` microbatches (the module docstring's schedule).

  mask: the attention mask of the whole batch (attn_lib.training_mask: [B, T] segment ids
  or [B, 1, T, T]); every array input is cut into microbatches along its first axis.
  The stages share out the blocks after any leading run of another structure
  (split_stages), which `run` takes first on the whole batch.
  """
  prefix, staged = split_stages(blocks)
  if prefix:
    x_BxTxD = run(prefix, x_BxTxD, positions_BxT, mask)
  s, n = stages, microbatches
  if len(staged) % s or x_BxTxD.shape[0] % n:
    raise ValueError(f'{len(staged)} staged layers and {x_BxTxD.shape[0]} rows do not divide '
                     f'into {s} stages and {n} microbatches')
  per_stage = len(staged) // s
  graphdef = nnx.graphdef(staged[0])
  params_S = _stacked_params(staged, s)
  x_N = _split_micro(x_BxTxD, n)
  pos_N, mask_N = _split_micro(positions_BxT, n), _split_micro(mask, n)
  act = ('batch', 'length', 'act_embed')

  def stage(params_K, x, positions, stage_mask):
    """One stage's layers on one microbatch; (output, each layer's MoE statistics)."""
    layer_blocks = [nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], params_K))
                    for k in range(per_stage)]
    y = run(layer_blocks, x, positions, stage_mask)
    return y, [nnx.state(b, nnx.Intermediate) for b in layer_blocks]

  vstage = jax.vmap(stage, spmd_axis_name=STAGE_AXIS if _staged_mesh() else None)
  iterations = n + s - 1
  # stage 0's input at each iteration: the microbatches, then S - 1 that it idles on
  feed = jnp.concatenate([x_N, jnp.zeros((s - 1,) + x_N.shape[1:], x_N.dtype)])
  stage_ids = jnp.arange(s)

  def step(buf_S, xs):
    t, x_in = xs
    # stage s takes stage s - 1's output of the last iteration; stage 0 the next microbatch
    buf_S = _stage_constrain(jnp.roll(buf_S, 1, axis=0).at[0].set(x_in), act)
    micro_S = jnp.clip(t - stage_ids, 0, n - 1)  # the microbatch each stage works on
    out_S, stats = vstage(params_S, buf_S, pos_N[micro_S], mask_N[micro_S])
    out_S = _stage_constrain(out_S, act)
    return out_S, (out_S[s - 1], stats)

  buf = _stage_constrain(jnp.zeros((s,) + x_N.shape[1:], x_N.dtype), act)
  _, (last_I, stats_I) = jax.lax.scan(step, buf, (jnp.arange(iterations), feed))
  _restore_stats(staged, stats_I, s, n)
  return _merge_micro(last_I[s - 1:])


def _restore_stats(staged, stats_I, stages: int, microbatches: int) -> None:
  """The per-iteration statistics [I, S, ...] of each stage's k-th layer onto its block:
  summed over the iterations where its stage worked on a microbatch (t - s in [0, N)),
  the batch means among them averaged."""
  t_I = jnp.arange(stages + microbatches - 1)[:, None]
  worked_IxS = (t_I - jnp.arange(stages)[None, :] >= 0) & (t_I - jnp.arange(stages) < microbatches)

  def combine(path, a_IxS):
    w = worked_IxS.reshape(worked_IxS.shape + (1,) * (a_IxS.ndim - 2))
    total_S = jnp.sum(jnp.where(w, a_IxS, 0), axis=0)  # an idle slot's values never enter
    names = {str(getattr(p, 'key', getattr(p, 'name', ''))) for p in path}
    return total_S / microbatches if names & set(_MEAN_STATS) else total_S

  per_stage = len(staged) // stages
  for k, stats in enumerate(stats_I):
    total = jax.tree_util.tree_map_with_path(combine, stats)
    for si in range(stages):
      nnx.update(staged[si * per_stage + k], jax.tree.map(lambda a, si=si: a[si], total))
