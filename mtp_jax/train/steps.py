"""The compiled steps: one train step and one eval step, pure functions of (state, batch).

The model and optimizer are split once into a static graphdef and an nnx.State pytree,
merged back inside `jax.jit`, which has explicit in/out shardings and donates the state.
What the steps read of a config is a `StepArgs` (with the loss's `LossArgs`), built once
before tracing: the traced code never reads the config. `setup` validates a config,
builds the mesh and the sharded state, and jits both.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mtp_jax.train.loss as loss_lib
import mtp_jax.train.resilience as resilience
from mtp_jax.config.readers import optional
from mtp_jax.config.validation import validate
from mtp_jax.data import tokenizers
from mtp_jax.model import moe
from mtp_jax.runtime import profiling, sharding
from mtp_jax.train_state import state as state_lib
from mtp_jax.train_state.optimizer import lr_at, schedule_inputs, trainable


def loss_args(config) -> loss_lib.LossArgs:
  """The loss's settings of `config` (a field that a config saved before it existed lacks
  takes its default)."""
  mtp = config.model.mtp

  def opt(dotted, default):
    return optional(config, dotted, default)

  return loss_lib.LossArgs(
      mtp_depth=int(mtp.depth),
      weights=tuple(float(w) for w in mtp.weights),
      lambda_schedule=opt('model.mtp.lambda_schedule', 'step'),
      lambda_values=tuple(float(v) for v in mtp.lambda_values),
      lambda_boundaries=tuple(int(b) for b in mtp.lambda_boundaries),
      curriculum=opt('model.mtp.curriculum', 'none'),
      curriculum_phase_steps=int(opt('model.mtp.curriculum_phase_steps', 0)),
      steps=int(config.train.steps),
      mtp_kind=opt('model.mtp.kind', 'sequential'),
      mtp_target_offsets=tuple(int(o) for o in opt('model.mtp.target_offsets', ())),
      chunk=int(config.model.loss_chunk),
      mtp_targets=opt('loss.mtp_targets', 'data'),
      balance_weight=float(opt('model.moe.balance_loss_weight', 0.0)))


@dataclasses.dataclass(frozen=True)
class StepArgs:
  """What the train and eval steps read of a config, resolved once (from_config) and
  closed over by the jitted steps as Python values."""
  loss: loss_lib.LossArgs
  grad_accum: int = 1  # train.grad_accum: microbatches per step
  bias_update_rate: float = 0.0  # model.moe.bias_update_rate
  trainable: Any = nnx.Param  # the nnx filter of the parameters updated (train_state)
  # schedule_inputs(config): compiled in when a train step is called without a schedule
  schedule: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(cls, config) -> StepArgs:
    """The steps' settings of `config` (defaults for fields an older config lacks)."""
    rate = optional(config, 'model.moe.bias_update_rate', 0.0)
    return cls(loss=loss_args(config), grad_accum=int(config.train.grad_accum),
               bias_update_rate=float(rate), trainable=trainable(config),
               schedule=schedule_inputs(config))


@dataclasses.dataclass
class TrainSetup:
  """Everything static about a run: mesh, graphdef, shardings, compiled steps."""
  config: Any
  mesh: jax.sharding.Mesh
  rules: tuple
  graphdef: Any
  state_shardings: Any
  abstract_state: Any
  train_step: Callable
  eval_step: Callable


def _split_micro(x, accum: int):
  """[B, ...] -> [A, B/A, ...] taking rows j*A + m into microbatch m (keeps shards local)."""
  b = x.shape[0]
  return x.reshape((b // accum, accum) + x.shape[1:]).swapaxes(0, 1)


def train_step(args: StepArgs, graphdef, state, batch, schedule=None):
  """One optimizer step: accumulated gradients of the weighted multi-depth loss.

  args: StepArgs.from_config(config). schedule: schedule_inputs(config) as arrays, inputs
  of the program rather than constants in it (None: args.schedule, compiled in). A
  non-finite loss or gradient norm returns the input state unchanged (metric `skipped`).
  """
  schedule = args.schedule if schedule is None else schedule
  la = args.loss
  old_state = jax.tree.map(lambda x: x, state)  # nnx.merge aliases `state`'s variables
  model, optimizer = nnx.merge(graphdef, state)
  mtp_depth = la.mtp_depth
  step = optimizer.step[...]
  weights = loss_lib.depth_weights(la, step, schedule['steps'])
  active = loss_lib.active_depths(la, step, schedule['steps'])
  # Normalisers from the whole batch: microbatch gradients then sum to the big-batch one.
  counts = loss_lib.valid_counts(batch['segment_ids'], mtp_depth, model.args.target_offsets())
  # The frozen parameters (model.mtp.freeze_trunk) go to `rest`: no gradient for them.
  model_graph, params, rest = nnx.split(model, args.trainable, ...)

  def loss_fn(p, mb):
    m = nnx.merge(model_graph, p, rest)
    return loss_lib.loss_and_metrics(m, mb, weights, counts, la.chunk, la.mtp_targets,
                                     la.balance_weight)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  accum = args.grad_accum
  if accum == 1:
    (loss, sums), grads = grad_fn(params, batch)
  else:
    micro = jax.tree.map(lambda x: _split_micro(x, accum), batch)

    def body(carry, mb):
      out = grad_fn(params, mb)
      return jax.tree.map(jnp.add, carry, out), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params,
                                                        jax.tree.map(lambda x: x[0], micro)))
    ((loss, sums), grads), _ = jax.lax.scan(body, zeros, micro)
  with jax.named_scope(profiling.OPTIMIZER_SCOPE):
    grad_norm = optax.tree.norm(grads)
    optimizer.update(model, grads, schedule=schedule)
  if 'moe_load' in sums:  # aux-loss-free balancing: the routing bias, outside the gradient
    sums.update(moe.update_bias(model, sums['moe_load'], args.bias_update_rate))
  new_state = nnx.state((model, optimizer))  # after every update of this step
  if la.curriculum != 'none':
    new_state = hold_inactive_depths(old_state, new_state, active)
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': lr_at(step, schedule),
             'lambda': weights[1:].sum() if mtp_depth else jnp.zeros(()),
             'active_depths': active, **sums}
  return resilience.keep_finite_update(old_state, new_state, metrics)


def _mtp_depth_of(path) -> int | None:
  """k for a state leaf of MTP depth k (a path through 'mtp', k - 1), else None: the
  model's own parameters and the optimizer's moments of them alike."""
  keys = [getattr(p, 'key', getattr(p, 'idx', None)) for p in path]
  for a, b in zip(keys, keys[1:]):
    if a == 'mtp' and isinstance(b, int):
      return b + 1
  return None


def hold_inactive_depths(old_state, new_state, active):
  """new_state with every leaf of an inactive MTP depth (k > active) taken from old_state.

  An inactive depth's loss weight is 0, so its gradient is 0 already; holding its
  parameters and Adam moments also stops the momentum of earlier steps and the weight
  decay from moving it: a switched-off depth stays as it was, a not-yet-active one at
  its initialisation (as an optimizer that skips parameters without a gradient does).
  A select per leaf: shapes and the compiled step are the same at every step.
  """
  def pick(path, old, new):
    k = _mtp_depth_of(path)
    return new if k is None else jnp.where(k <= active, new, old)
  return jax.tree_util.tree_map_with_path(pick, old_state, new_state)


def eval_step(args: StepArgs, graphdef, state, batch, token_bytes_V):
  """Summed per-depth statistics on one batch (against the data, whatever
  loss.mtp_targets trains), plus target bytes for bits per byte."""
  model, _ = nnx.merge(graphdef, state)
  mtp_depth = args.loss.mtp_depth
  weights = jnp.ones((mtp_depth + 1,), jnp.float32)
  _, sums = loss_lib.loss_and_metrics(model, batch, weights, None, args.loss.chunk)
  seg = batch['segment_ids']
  offsets = model.args.target_offsets()
  byte_sums = [jnp.sum(jnp.where(loss_lib.valid_mask(seg, k, offsets),
                                 token_bytes_V[loss_lib.targets(batch['tokens'], k, offsets)], 0))
               for k in range(mtp_depth + 1)]
  sums['bytes'] = jnp.stack(byte_sums).astype(jnp.float32)
  return sums


class ScheduledStep:
  """The jitted train step called as (state, batch): the schedule's values
  (schedule_inputs) go in as arguments, so the compiled program holds none of them.
  `.lower(state, batch).compile()` gives a program called the same way."""

  def __init__(self, fn, schedule: dict):
    self.fn, self.schedule = fn, schedule

  def __call__(self, state, batch):
    return self.fn(state, batch, self.schedule)

  def lower(self, state, batch) -> ScheduledStep:
    return ScheduledStep(self.fn.lower(state, batch, self.schedule), self.schedule)

  def compile(self) -> ScheduledStep:
    return ScheduledStep(self.fn.compile(), self.schedule)

  def __getattr__(self, name):  # memory_analysis, cost_analysis, as_text, ...
    return getattr(self.fn, name)


def setup(config, devices=None) -> tuple[TrainSetup, Any]:
  """Validates, builds the mesh and the sharded state, and jits the steps."""
  devices = jax.devices() if devices is None else devices
  tokenizers.resolve_vocab_size(config)
  validate(config, len(devices))
  mesh = sharding.make_mesh(config, devices)
  rules = sharding.rules_of(config)
  graphdef, state, shardings, abstract = state_lib.init_state(config, mesh, rules)
  with sharding.use_mesh(mesh, rules):
    batch_sh = sharding.batch_sharding(mesh)
  rep = sharding.replicated(mesh)
  batch_shardings = {'tokens': batch_sh, 'segment_ids': batch_sh, 'positions': batch_sh}
  args = StepArgs.from_config(config)
  step_fn = jax.jit(functools.partial(train_step, args, graphdef),
                    in_shardings=(shardings, batch_shardings, rep),
                    out_shardings=(shardings, rep), donate_argnums=0)
  schedule = jax.device_put(schedule_inputs(config), rep)
  eval_fn = jax.jit(functools.partial(eval_step, args, graphdef),
                    in_shardings=(shardings, batch_shardings, rep), out_shardings=rep)
  return TrainSetup(config, mesh, rules, graphdef, shardings, abstract,
                    ScheduledStep(step_fn, schedule), eval_fn), state


def run_step(ts: TrainSetup, state, batch):
  """Calls the compiled step under the mesh and logical-axis rules (host numpy in)."""
  with sharding.use_mesh(ts.mesh, ts.rules):
    gbatch = sharding.host_batch_to_global(batch, ts.mesh)
    return ts.train_step(state, gbatch)
