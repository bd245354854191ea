"""The blocks of a model: which attention and MLP kinds each layer is, and running a stack
of blocks (rematerialised under config.model.remat, scanned under model.scan_layers)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax.model.attention as attn_lib
import mtp_jax.model.layers as layers
import mtp_jax.model.moe as moe
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.kind_classes import ATTENTION_KINDS, MLP_KINDS

Array = jax.Array


def block_kinds(args: ModelArgs, layer: int) -> tuple[str, str]:
  """(attention kind, MLP kind) names of trunk layer `layer`; layer n_layers is the MTP
  block.

  Dense MLPs in layers [0, first_k_dense), MoE after when args.mlp is 'moe'; the MTP
  blocks take that rule at index n_layers (MoE, as DeepSeek-V3's MTP layer 61) unless
  mtp_block_attention / mtp_block_mlp name a kind.
  """
  attention, mlp = args.attention, args.mlp
  if mlp == 'moe' and layer < args.first_k_dense:
    mlp = 'dense'
  if layer >= args.n_layers:
    attention = args.mtp_block_attention or attention
    mlp = args.mtp_block_mlp or mlp
  return attention, mlp


def block_classes(args: ModelArgs, layer: int) -> tuple:
  """(attention class, MLP class) of trunk layer `layer` (block_kinds' names)."""
  attention, mlp = block_kinds(args, layer)
  return ATTENTION_KINDS[attention], MLP_KINDS[mlp]


# what each block policy keeps beyond `block`'s (layers: the names Block and MLP give them)
_KEPT_BEYOND_BLOCK = {'block': (), 'block_norms': (layers.NORM_SAVED_NAME,),
                      'block_mlp': (layers.MLP_SAVED_NAME,),
                      'block_inputs': (layers.NORM_SAVED_NAME, layers.MLP_SAVED_NAME)}


def remat_policy(name: str):
  """The jax.checkpoint policy of config.model.remat (None: no rematerialisation).

  block:        keep each block's weight-matmul outputs (q/k/v/o, gate/up/down
                projections, the routed experts' grouped products: moe.EXPERT_SAVED_NAME)
                and the attention core's residuals (attn_lib.ATTENTION_SAVED_NAMES: the
                blocked core's custom VJP, the splash / Triton kernels' output and
                log-sum-exp); recompute the norms, the SwiGLU product and, where that core
                is not used, RoPE and the attention scores and softmax.
  block_norms:  block, and the two RMSNorm outputs of each block (the inputs of the
                q/k/v and gate/up matmuls: their weight gradients need them) with their
                row rsqrt: no norm is recomputed ([B, T, D] twice per layer more).
  block_mlp:    block, and the SwiGLU product (the down projection's input): [B, T, F]
                per layer more.
  block_inputs: both: every weight matmul's input and output is kept.
  full:         keep only each block's input; recompute the whole block in the backward
                pass.
  """
  if name == 'none':
    return None
  if name in _KEPT_BEYOND_BLOCK:
    # plus the attention core's named residuals (output, row log-sum-exp and, for the
    # blocked core, heads-major q / k / v): its backward needs only those, never a rerun
    # of its forward
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*attn_lib.ATTENTION_SAVED_NAMES,
                                                      moe.EXPERT_SAVED_NAME,
                                                      *_KEPT_BEYOND_BLOCK[name]))
  if name == 'full':
    return jax.checkpoint_policies.nothing_saveable
  raise ValueError(f'unknown remat policy {name!r}')


def _apply_block(graphdef, state, x, positions, mask):
  """A pure function of the block's state (what jax.checkpoint and lax.scan need)."""
  block = nnx.merge(graphdef, state)
  out, _ = block(x, positions, mask)
  return out, nnx.state(block, nnx.Intermediate)  # MoE routing statistics, if any


def run_blocks(blocks, x_BxTxD, positions_BxT, mask, remat: str = 'none',
               scan: bool = False) -> Array:
  """x through `blocks` in order (no caches), optionally rematerialised and scanned.

  With scan, the per-layer parameters of each run of same-structure blocks
  (_same_structure_runs) are stacked inside the traced computation and one block body is
  scanned over them: the HLO holds one block per run instead of L (compile time on deep
  models; one block's buffers reused layer after layer), while the parameter tree
  (checkpoints, the decoder's per-layer loop) stays a list of blocks whatever remat /
  scan are. MoE statistics leave the scan stacked and go back onto each block.
  """
  policy = remat_policy(remat)

  def block_fn(graphdef, in_scan):
    fn = functools.partial(_apply_block, graphdef)
    # Inside a scan the loop already keeps XLA from merging recomputation with the
    # forward pass, so CSE prevention is not needed there (JAX's advice for scans).
    return fn if policy is None else jax.checkpoint(fn, policy=policy, prevent_cse=not in_scan)

  for run in (_same_structure_runs(blocks) if scan else [[b] for b in blocks]):
    graphdef, state = nnx.split(run[0])
    fn = block_fn(graphdef, len(run) > 1)
    if len(run) == 1:
      x_BxTxD, stats = fn(state, x_BxTxD, positions_BxT, mask)
      nnx.update(run[0], stats)  # out of the pure function onto the block (moe.collect)
      continue
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in run])

    def body(x, state, fn=fn):
      return fn(state, x, positions_BxT, mask)  # the MoE statistics leave stacked, [L, ...]

    x_BxTxD, stats_L = jax.lax.scan(body, x_BxTxD, stacked)
    for i, block in enumerate(run):
      nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stats_L))
  return x_BxTxD


def _same_structure_runs(blocks) -> list[list]:
  """Consecutive blocks of one structure (graphdef), each run scanned on its own: the dense
  first layers of a DeepSeekMoE trunk, then its MoE layers."""
  runs = []
  for block in blocks:
    if runs and nnx.graphdef(block) == nnx.graphdef(runs[-1][0]):
      runs[-1].append(block)
    else:
      runs.append([block])
  return runs
