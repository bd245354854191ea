"""Training: state built on the mesh, one jitted train step, the loop with eval and checkpoints.

The train step is a pure module-level function of (state, batch): the model and
optimizer are split once into a static graphdef and an nnx.State pytree, merged back
inside `jax.jit`, which has explicit in/out shardings and donates the state.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config_lib
from mtp_jax import evaluation
from mtp_jax import flops as flops_lib
from mtp_jax import loss as loss_lib
from mtp_jax import metrics as metrics_lib
from mtp_jax import resilience
from mtp_jax import sharding
from mtp_jax.model import MTPModel, ModelArgs


# -- optimizer ----------------------------------------------------------------------------
def lr_schedule(config) -> optax.Schedule:
  t = config.train
  warmup = min(t.warmup_steps, max(t.steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
      decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)


def build_optimizer(config) -> optax.GradientTransformation:
  """AdamW with warmup + cosine, global-norm clipping; no decay on norms (1-D params)."""
  t = config.train
  adamw = optax.adamw(lr_schedule(config), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
  if t.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
  return adamw


def trainable(config):
  """The nnx filter of the parameters the optimizer updates (model.mtp.freeze_trunk: MTP only).

  Frozen parameters are left out of the optimizer rather than given zero updates
  (optax.set_to_zero): no gradient is computed for them, they hold no Adam moments, and
  they are never written, so they stay bit-identical (p + 0.0 would turn -0.0 into 0.0).
  """
  if config_lib.optional(config, 'model.mtp.freeze_trunk', False):
    return nnx.All(nnx.Param, nnx.PathContains('mtp'))
  return nnx.Param


def create_model_and_optimizer(config) -> tuple[MTPModel, nnx.Optimizer]:
  model = MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(config.seed))
  return model, nnx.Optimizer(model, build_optimizer(config), wrt=trainable(config))


# -- state on the mesh -------------------------------------------------------------------
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


def init_state(config, mesh, rules):
  """(graphdef, state, shardings, abstract): parameters created directly on the mesh."""
  with sharding.use_mesh(mesh, rules):
    abstract = nnx.eval_shape(lambda: create_model_and_optimizer(config))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.state_shardings(abstract_state, mesh)
    state = jax.jit(lambda: nnx.split(create_model_and_optimizer(config))[1],
                    out_shardings=shardings)()
  abstract_state = ckpt_lib.abstract_like(abstract_state, shardings)
  return graphdef, state, shardings, abstract_state


def _split_micro(x, accum: int):
  """[B, ...] -> [A, B/A, ...] taking rows j*A + m into microbatch m (keeps shards local)."""
  b = x.shape[0]
  return x.reshape((b // accum, accum) + x.shape[1:]).swapaxes(0, 1)


def train_step(config, graphdef, state, batch):
  """One optimizer step: accumulated gradients of the weighted multi-depth loss.

  A non-finite loss or gradient norm returns the input state unchanged (metric `skipped`).
  """
  old_state = jax.tree.map(lambda x: x, state)  # nnx.merge aliases `state`'s variables
  model, optimizer = nnx.merge(graphdef, state)
  num_depths = config.model.mtp.depth + 1
  step = optimizer.step[...]
  weights = loss_lib.depth_weights(config, step)
  # Normalisers from the whole batch: microbatch gradients then sum to the big-batch one.
  counts = loss_lib.valid_counts(batch['segment_ids'], num_depths)
  model_graph, params, rest = nnx.split(model, trainable(config), ...)  # frozen params in rest
  mtp_targets = config_lib.optional(config, 'loss.mtp_targets', 'data')

  def loss_fn(p, mb):
    m = nnx.merge(model_graph, p, rest)
    return loss_lib.loss_and_metrics(m, mb, weights, counts, config.model.loss_chunk,
                                     mtp_targets)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  accum = config.train.grad_accum
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
  grad_norm = optax.global_norm(grads)
  optimizer.update(model, grads)
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': lr_schedule(config)(step),
             'lambda': weights[1:].sum() if num_depths > 1 else jnp.zeros(()), **sums}
  return resilience.keep_finite_update(old_state, nnx.state((model, optimizer)), metrics)


def eval_step(config, graphdef, state, batch, token_bytes_V):
  """Summed per-depth statistics on one batch, plus target bytes for bits per byte."""
  model, _ = nnx.merge(graphdef, state)
  num_depths = config.model.mtp.depth + 1
  weights = jnp.ones((num_depths,), jnp.float32)
  _, sums = loss_lib.loss_and_metrics(model, batch, weights, None, config.model.loss_chunk)
  seg = batch['segment_ids']
  byte_sums = [jnp.sum(jnp.where(loss_lib.valid_mask(seg, k),
                                 token_bytes_V[loss_lib.targets(batch['tokens'], k)], 0))
               for k in range(num_depths)]
  sums['bytes'] = jnp.stack(byte_sums).astype(jnp.float32)
  return sums


def setup(config, devices=None) -> tuple[TrainSetup, Any]:
  """Validates, builds the mesh and the sharded state, and jits the steps."""
  devices = jax.devices() if devices is None else devices
  config_lib.validate(config, len(devices))
  mesh = sharding.make_mesh(config, devices)
  rules = sharding.rules_of(config)
  graphdef, state, shardings, abstract = init_state(config, mesh, rules)
  with sharding.use_mesh(mesh, rules):
    batch_sh = sharding.batch_sharding(mesh)
  rep = sharding.replicated(mesh)
  batch_shardings = {'tokens': batch_sh, 'segment_ids': batch_sh, 'positions': batch_sh}
  step_fn = jax.jit(functools.partial(train_step, config, graphdef),
                    in_shardings=(shardings, batch_shardings),
                    out_shardings=(shardings, rep), donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, config, graphdef),
                    in_shardings=(shardings, batch_shardings, rep), out_shardings=rep)
  return TrainSetup(config, mesh, rules, graphdef, shardings, abstract, step_fn, eval_fn), state


def run_step(ts: TrainSetup, state, batch):
  """Calls the compiled step under the mesh and logical-axis rules (host numpy in)."""
  with sharding.use_mesh(ts.mesh, ts.rules):
    gbatch = sharding.host_batch_to_global(batch, ts.mesh)
    return ts.train_step(state, gbatch)


def padded_token_bytes(config, tokenizer) -> np.ndarray:
  """UTF-8 bytes of each token id, padded to the model's vocabulary (bits per byte)."""
  token_bytes = tokenizer.token_bytes()
  vocab = ModelArgs.from_config(config).vocab_size
  return np.pad(token_bytes, (0, vocab - len(token_bytes)), constant_values=1)


def evaluate(ts: TrainSetup, state, batches, token_bytes_V) -> dict:
  """eval/... per-depth loss, accuracy, agreement and bits per byte over `batches`."""
  total = None
  with sharding.use_mesh(ts.mesh, ts.rules):
    tb = jax.device_put(jnp.asarray(token_bytes_V, jnp.int32), sharding.replicated(ts.mesh))
    for batch in batches:
      sums = ts.eval_step(state, sharding.host_batch_to_global(batch, ts.mesh), tb)
      total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  total = jax.device_get(total)
  out = {k: float(v) for k, v in loss_lib.summarize(total, 'eval').items()}
  bpb = total['loss_sum'] / (math.log(2) * np.maximum(total['bytes'], 1.0))
  out['eval/bpb_main'] = float(bpb[0])
  for k in range(1, len(bpb)):
    out[f'eval/bpb_mtp_{k}'] = float(bpb[k])
  out['eval/tokens'] = float(total['count'][0])
  return out


# -- the loop ------------------------------------------------------------------------------
class _Window:
  """Host-side sums of step metrics between two log lines (checkpointed, so a resumed run
  writes the same log lines as an uninterrupted one)."""

  def __init__(self):
    self.reset()

  def reset(self):
    self.sums, self.steps, self.loss, self.skipped, self.start = None, 0, 0.0, 0, time.time()
    self.excluded = 0.0  # seconds spent in eval and saving, not training

  def add(self, m: dict):
    stats = {k: m[k] for k in ('loss_sum', 'correct', 'agree', 'count')}
    self.sums = stats if self.sums is None else {k: self.sums[k] + stats[k] for k in stats}
    self.steps += 1
    self.loss += float(m['loss'])

  def to_json(self) -> dict:
    sums = None if self.sums is None else {k: [float(x) for x in np.asarray(v).ravel()]
                                           for k, v in self.sums.items()}
    return {'sums': sums, 'steps': self.steps, 'loss': self.loss, 'skipped': self.skipped}

  def load(self, d: dict | None):
    if not d:
      return
    self.sums = None if d['sums'] is None else {k: np.asarray(v, np.float32)
                                                for k, v in d['sums'].items()}
    self.steps, self.loss, self.skipped = int(d['steps']), float(d['loss']), int(d['skipped'])


def train_and_evaluate(config, workdir: str, *, devices=None, stop_after: int | None = None,
                       init_from: str | None = None, batch_hook=None) -> dict:
  """Trains `config` in `workdir`, resuming from its latest good checkpoint if one exists.

  stop_after: stop (with a checkpoint) once this step is reached, as a preempted job
  would; the schedule still follows config.train.steps. SIGTERM / SIGINT do the same
  at the end of the current step. init_from: a workdir or checkpoint whose trunk and
  shared embedding/head start this run (ignored once the run has checkpoints of its
  own). batch_hook(step, batch) -> batch: a test hook for fault injection. Returns the
  last metrics.
  """
  from mtp_jax.data import pipeline, tokenizers  # heavy imports only when training

  workdir = os.path.abspath(workdir)
  devices = jax.devices() if devices is None else devices
  config_lib.validate(config, len(devices))
  resilience.check_workdir(workdir)
  resilience.validate_data(config, jax.process_count())
  resilience.check_document_lengths(config)
  tokenizer = tokenizers.get_tokenizer(config.data)
  is_main = jax.process_index() == 0
  progress = metrics_lib.Progress(config.train.steps, enabled=config.train.progress and is_main)

  def notify(text):  # events that must be seen even without the progress line
    if not is_main:
      return
    if progress.enabled:
      progress.message(text)
    else:
      print(text, file=sys.stderr, flush=True)

  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'),
                                       max_to_keep=config.train.max_to_keep,
                                       async_save=config.train.async_checkpoint)
  if checkpointer.incomplete:
    notify(f'Ignoring incomplete checkpoint save(s) left by an interrupted run: '
           f'{", ".join(checkpointer.incomplete)} (removed).')
  config_dict = json.loads(config.to_json_best_effort())

  def check_meta(meta):
    ckpt_lib.check_compatible(meta.get('config', {}), config_dict, checkpointer.directory)

  has_checkpoints = bool(checkpointer.all_steps())
  try:  # fail before compiling anything
    for s in sorted(checkpointer.all_steps(), reverse=True):
      try:
        meta = checkpointer.read_meta(s)
      except Exception:  # pylint: disable=broad-except
        continue  # unreadable: restore_latest_good reports it and falls back
      check_meta(meta)
      break
    if init_from and not has_checkpoints:
      resilience.check_init_from(init_from, config, config_dict)
    if config.model.mtp.freeze_trunk and not (init_from or has_checkpoints):
      raise config_lib.ConfigError(
          'model.mtp.freeze_trunk would train MTP modules on a randomly initialised, frozen '
          'trunk: give --init_from=<a trained workdir or checkpoint>')
    abstract = nnx.eval_shape(lambda: nnx.split(create_model_and_optimizer(config))[1])
    resilience.check_disk_space(checkpointer.directory,
                                resilience.checkpoint_bytes_estimate(abstract))
    if is_main:  # the only writer of metrics.jsonl
      resilience.repair_jsonl(os.path.join(workdir, 'metrics.jsonl'))
    decode_prompts = evaluation.training_prompts(config, tokenizer)  # [] when off
  except BaseException:
    checkpointer.close()
    raise

  ts, state = setup(config, devices)
  data_iter = pipeline.make_train_iter(config, process_index=jax.process_index(),
                                       process_count=jax.process_count())
  start_step = 0
  window = _Window()
  monitor = resilience.NonFiniteMonitor(config.train.nonfinite,
                                        config.train.max_consecutive_skips, notify)
  init_desc = None
  if has_checkpoints:
    restored = checkpointer.restore_latest_good(ts.abstract_state, data_iter, check_meta)
    state, meta, start_step = restored.state, restored.meta, restored.step
    if restored.broken:
      notify('WARNING: ' + '; '.join(f'checkpoint {s} is broken ({r})' for s, r in restored.broken)
             + f'. Moved to {restored.moved_to}; restoring step {start_step} instead.')
    window.load(meta.get('window'))
    monitor.skipped_total = int(meta.get('skipped_total', 0))
    notify(f'Resumed from {checkpointer.directory} at step {start_step}.'
           + (' (--init_from ignored: the run has checkpoints of its own.)' if init_from else ''))
  elif init_from:
    state, init_desc = resilience.init_from(init_from, config, config_dict, state,
                                            ts.abstract_state, notify)
  if is_main:
    with open(os.path.join(workdir, 'config.json'), 'w') as f:
      f.write(config.to_json_best_effort(indent=2))
  writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
  mfu = flops_lib.MFU(config, devices)  # CPU: a matmul probe, run now in this process
  progress.message(mfu.describe())

  eval_batches = None
  token_bytes = padded_token_bytes(config, tokenizer)

  def run_eval(step):
    nonlocal eval_batches
    if eval_batches is None:
      eval_batches = list(pipeline.make_eval_batches(
          config, num_batches=config.train.eval_batches, process_index=jax.process_index(),
          process_count=jax.process_count()))
    out = evaluate(ts, state, eval_batches, token_bytes)
    if decode_prompts:  # every process decodes the same prompts alike; process 0 writes
      decoder = evaluation.local_decoder(ts.graphdef, state, ts.mesh)
      out.update(evaluation.decode_metrics(decoder, decode_prompts,
                                           config.train.eval_decode_tokens))
    writer.write(step, out)
    progress.message(f'eval @ {step}: ' + '  '.join(
        f'{k[5:]}={v:.4f}' for k, v in out.items()
        if 'bpb' in k or 'loss' in k or k == evaluation.TAU_KEY))
    return out

  last_saved = start_step if has_checkpoints else None

  def save(step):
    nonlocal last_saved
    meta = {'step': int(step), 'config': config_dict, 'window': window.to_json(),
            'skipped_total': monitor.skipped_total,
            **ckpt_lib.integrity_meta(state, data_iter)}
    if init_desc:
      meta['init_from'] = init_desc
    checkpointer.save(step, state, data_iter, meta, force=True)
    last_saved = step

  tokens_per_step = config.data.batch_size * config.data.seq_len
  end_step = config.train.steps if stop_after is None else min(stop_after, config.train.steps)
  last = {}
  pending = None  # (step, device metrics) fetched after the next step is dispatched

  def consume(step, m):
    nonlocal last
    m = jax.device_get(m)
    if monitor.check(step, m, last_saved):  # raises under train.nonfinite='halt'
      window.add(m)
    else:
      window.skipped += 1
    if step % config.train.log_every == 0 or step == end_step:
      elapsed = time.time() - window.start - window.excluded
      out = {}
      if window.steps:
        out = {k: float(v) for k, v in loss_lib.summarize(
            {k: jnp.asarray(v) for k, v in window.sums.items()}, 'train').items()}
        out['train/loss'] = window.loss / window.steps
        out['train/grad_norm'] = float(m['grad_norm'])
      out['train/lr'] = float(m['lr'])
      out['train/lambda'] = float(m['lambda'])
      out['train/skipped_steps'] = float(monitor.skipped_total)
      done = max(window.steps + window.skipped, 1)
      out['perf/tokens_per_sec'] = done * tokens_per_step / max(elapsed, 1e-9)
      out['perf/step_time'] = elapsed / done
      out.update(mfu.metrics(out['perf/tokens_per_sec']))
      writer.write(step, out)
      if window.steps:
        progress.update(step, out['train/loss'], out['perf/tokens_per_sec'])
      window.reset()
      last = out

  step = start_step
  compiled = None
  if start_step >= config.train.steps:
    notify(f'Nothing to do: the checkpoint in {workdir} is at the final step {start_step}.')
  error = None
  guard = resilience.PreemptionGuard(notify)  # SIGTERM / SIGINT: save at the end of the step
  try:
    guard.install()
    window.start = time.time()  # perf/: the first window starts at the first step, not at setup
    while step < end_step:
      batch = next(data_iter)
      if batch_hook is not None:
        batch = batch_hook(step + 1, batch)
      with sharding.use_mesh(ts.mesh, ts.rules):
        gbatch = sharding.host_batch_to_global(batch, ts.mesh)
        if compiled is None:  # ahead of time, so compilation is not counted as training
          t0 = time.time()
          compiled = ts.train_step.lower(state, gbatch).compile()
          window.excluded += time.time() - t0  # tokens/s and MFU measure training only
          progress.message(f'Compiled the train step in {time.time() - t0:.1f} s.')
        state, m = compiled(state, gbatch)
      step += 1
      if pending is not None:
        consume(*pending)
      pending = (step, m)
      stop = guard.should_stop(step)
      want_eval = config.train.eval_every and step % config.train.eval_every == 0
      want_ckpt = config.train.checkpoint_every and step % config.train.checkpoint_every == 0
      want_log = step % config.train.log_every == 0  # perf/: the window ends at a completed step
      if want_eval or want_ckpt or stop or want_log or step == end_step:
        consume(*pending)  # a checkpoint never holds a state whose loss was not checked
        pending = None
      t0 = time.time()
      if want_eval and step != config.train.steps and not stop:
        last.update(run_eval(step))
      if (want_ckpt or stop) and step != end_step:
        save(step)
      window.excluded += time.time() - t0
      if stop:
        notify(f'Preempted ({guard.signal_name}) at step {step}: saved a checkpoint; '
               'rerun the same command to resume.')
        break
    if pending is not None:
      consume(*pending)
    # The final eval comes before the final save: a kill in between redoes both.
    if start_step < step == config.train.steps and not guard.requested:
      last.update(run_eval(step))
    if last_saved != step:
      save(step)
    checkpointer.wait()  # a failed last save is an error, not a silent loss
  except BaseException as e:
    error = e
    raise
  finally:  # every closer runs; a failure surfaces unless another error is already on its way
    guard.uninstall()
    resilience.close_all(error, notify, checkpointer.close, writer.close, progress.close,
                         getattr(data_iter, 'close', None))
  return last
