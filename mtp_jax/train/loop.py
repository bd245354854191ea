"""The training loop: resume or start, train steps, periodic eval and checkpoints, shutdown.

What the loop runs lives elsewhere: the start of a run (its checks, the workdir's lock,
--init_from's source, the undo of a failed start) in start.py, the model and optimizer state
in mtp_jax.train_state, the compiled steps in steps.py, evaluation in evaluation.py,
checkpoints in mtp_jax.checkpoint, the preemption / non-finite policies in resilience.py.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import mtp_jax.train.evaluation as evaluation
import mtp_jax.train.flops as flops_lib
import mtp_jax.train.goodput as goodput_lib
import mtp_jax.train.loss as loss_lib
import mtp_jax.train.metrics as metrics_lib
import mtp_jax.train.resilience as resilience
import mtp_jax.train.start as start_lib
import mtp_jax.train.steps as steps
import mtp_jax.train.watchdog as watchdog_lib
from mtp_jax.checkpoint import compat as ckpt_compat
from mtp_jax.checkpoint import integrity as ckpt_integrity
from mtp_jax.checkpoint import store as ckpt_store
from mtp_jax.config.readers import optional, profile_window
from mtp_jax.data import pipeline
from mtp_jax.model import moe
from mtp_jax.runtime import profiling, sharding, signals
from mtp_jax.train.metrics import metric_key


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
                       init_from: str | start_lib.InitFrom | None = None, new_data: bool = False,
                       batch_hook=None) -> dict:
  """Trains `config` in `workdir`, resuming from its latest good checkpoint if one exists.

  stop_after: stop (with a checkpoint) once this step is reached, as a preempted job
  would; the schedule still follows config.train.steps. SIGTERM / SIGINT do the same
  at the end of the current step. init_from: a workdir or checkpoint whose trunk and
  shared embedding/head start this run (ignored once the run has checkpoints of its
  own). new_data: resume the workdir's model and optimizer on a data stream other than
  its checkpoints' (the data iterator starts afresh); without it that is a ConfigError.
  batch_hook(step, batch) -> batch: a test hook for fault injection. Returns the last
  metrics. config.json is written with each checkpoint: it always describes the newest one.
  """
  workdir = os.path.abspath(workdir)
  # SIGTERM / SIGINT before the first step end the start-up at its next safe point: the
  # command line's recorder (installed before its imports), else one from here on.
  startup = signals.for_process() or signals.StartupSignals().install()
  try:
    return _train(config, workdir, devices, stop_after, init_from, batch_hook, new_data,
                  startup)
  finally:
    startup.uninstall()


def _train(config, workdir, devices, stop_after, init_from, batch_hook, new_data, startup):
  """train_and_evaluate's body; `startup.check()` marks its safe points."""
  ledger = goodput_lib.Ledger()  # every second from here goes to one bucket
  startup.check()
  devices = jax.devices() if devices is None else devices
  with start_lib.Start(config, workdir, devices, init_from, new_data, startup) as start:
    run = _start(start, ledger)
    startup.check()
    if run.start_step >= config.train.steps:
      start.notify(f'Nothing to do: the checkpoint in {workdir} is at the final step '
                   f'{run.start_step}.')
    end_step = config.train.steps if stop_after is None else min(stop_after, config.train.steps)
    run.startup = startup  # checked once more just before the first step
    start.hand_over()
    out = run.loop(end_step, batch_hook)  # shuts down (checkpoint writes included) first
  if run.last_saved == config.train.steps:
    host_lines = goodput_lib.host_lines(goodput_lib.host_totals(ledger.job()))  # a collective
    start.notify('\n'.join([ledger.summary(), *host_lines]))
    prompt = run.suggested_prompt(start.tokenizer)  # decode's cache holds data.seq_len positions
    room = config.data.seq_len - len(start.tokenizer.encode(prompt))
    start.notify(metrics_lib.final_block(workdir, run.last_saved, run.last_saved, prompt, room))
  return out


def _start(start: start_lib.Start, ledger) -> _Run:
  """The run's state on the mesh: resumed, or loaded from --init_from, or fresh."""
  config, devices, notify = start.config, start.devices, start.notify
  ledger.lap('other')
  ts, state = steps.setup(config, devices)
  ledger.lap('compile')  # the initialiser's program, and the state built with it
  data_iter = pipeline.make_train_iter(config, process_index=jax.process_index(),
                                       process_count=jax.process_count())
  run = _Run(config, start.config_dict, ts, state, data_iter, start.checkpointer, notify)
  run.new_data = bool(start.data_changes)
  run.workdir = start.workdir
  run.ledger = ledger
  run.progress = start.progress
  run.decode_prompts = start.decode_prompts
  run.resume(start.source)
  ledger.lap('restore')
  if start.data_changes:
    notify(f'--new_data: step {run.start_step}\'s model and optimizer continue on '
           + '; '.join(start.data_changes) + ' (its data iterator starts at the beginning).')
  run.writer = metrics_lib.MetricWriter(start.workdir, enabled=jax.process_index() == 0,
                                        wandb=optional(config, 'train.wandb', None),
                                        run_config=start.config_dict)
  # CPU: the cached peak, checked against a quick matmul probe now, in this process.
  run.mfu = flops_lib.MFU(config, devices, notify=notify)
  notify.progress.message(metrics_lib.devices_line(devices, dict(ts.mesh.shape),
                                                   jax.process_count()))
  notify.progress.message(run.mfu.describe())
  notify.progress.message(metrics_lib.data_line(config))
  run.token_bytes = evaluation.padded_token_bytes(config, start.tokenizer)
  return run


class _Run:
  """One run's live state; each part of the loop is a method over it."""

  def __init__(self, config, config_dict, ts: steps.TrainSetup, state, data_iter,
               checkpointer: ckpt_store.Checkpointer, notify):
    self.config, self.config_dict, self.ts, self.state = config, config_dict, ts, state
    self.data_iter, self.checkpointer, self.notify = data_iter, checkpointer, notify
    self.window = _Window()
    self.monitor = resilience.NonFiniteMonitor(config.train.nonfinite,
                                               config.train.max_consecutive_skips, notify)
    self.start_step = 0
    self.last_saved = None  # step of the newest checkpoint
    self.init_desc = None  # what --init_from loaded, recorded in every checkpoint's meta
    self.eval_batches = None  # read at the first eval
    self.last = {}  # the newest metrics logged
    self.end_step = config.train.steps
    # Set by train_and_evaluate before the loop starts.
    self.writer = self.progress = self.mfu = self.token_bytes = None
    self.decode_prompts = []
    self.workdir = os.path.dirname(checkpointer.directory)  # _start sets the real one
    self.new_data = False  # resume on another data stream: the iterator is not restored
    self.startup = None  # signals.StartupSignals of the start-up, until the first step
    self.ledger = goodput_lib.Ledger()  # _start gives the run's own
    self._input_mark = 0.0  # the ledger's input seconds at the previous log line

  def _check_meta(self, meta):
    ckpt_compat.check_compatible(meta.get('config', {}), self.config_dict,
                                 self.checkpointer.directory, self.new_data)

  def resume(self, source: start_lib.InitSource | None):
    """The latest good checkpoint of this run, else --init_from's trunk, else a fresh start."""
    notify = self.notify
    meta = {}
    if self.checkpointer.all_steps():
      restored = self.checkpointer.restore_latest_good(
          self.ts.abstract_state, None if self.new_data else self.data_iter, self._check_meta)
      self.state, meta, self.start_step = restored.state, restored.meta, restored.step
      if restored.broken:
        notify('WARNING: ' + '; '.join(f'checkpoint {s} is broken ({r})'
                                       for s, r in restored.broken)
               + f'. Moved to {restored.moved_to}; restoring step {self.start_step} instead.')
      self.window.load(meta.get('window'))
      self.monitor.skipped_total = int(meta.get('skipped_total', 0))
      notify(f'Resumed from {restored.directory or self.checkpointer.directory} at step '
             f'{self.start_step}.'
             + (' (--init_from ignored: the run has checkpoints of its own.)'
                if source is not None else ''))
      self.last_saved = self.start_step
    elif source is not None:
      self.state, self.init_desc = source.load(self.config, self.config_dict, self.state,
                                               self.ts.abstract_state, notify)
    # Goodput: what an earlier attempt did after this checkpoint (or without one) is redone.
    lost = self.ledger.resume(meta.get('goodput'), goodput_lib.read_side_file(self.workdir))
    if lost > 0:
      notify(f'{lost:.1f} s of an earlier attempt came after step {self.start_step} and are '
             'done again (perf/job_time/lost).')

  def evaluate(self, step: int) -> dict:
    """Teacher-forced eval (and decoding, when configured), written to the log."""
    config, ts = self.config, self.ts
    if self.eval_batches is None:
      self.eval_batches = list(pipeline.make_eval_batches(
          config, num_batches=config.train.eval_batches, process_index=jax.process_index(),
          process_count=jax.process_count()))
    self.ledger.lap('train')
    out = evaluation.evaluate(ts, self.state, self.eval_batches, self.token_bytes)
    if self.decode_prompts:  # every process decodes the same prompts alike; process 0 writes
      decoder = evaluation.local_decoder(ts.graphdef, self.state, ts.mesh)
      out.update(evaluation.decode_metrics(decoder, self.decode_prompts,
                                           config.train.eval_decode_tokens))
    self.ledger.lap('eval')
    self.writer.write(step, out)
    self.progress.message(metrics_lib.eval_line(step, out))
    return out

  def suggested_prompt(self, tokenizer) -> str:
    """The start of a validation document, for the final block's decode line."""
    batches = self.eval_batches or pipeline.make_eval_batches(
        self.config, num_batches=1, process_index=jax.process_index(),
        process_count=jax.process_count())
    return evaluation.suggested_prompt(tokenizer, batches)

  def save(self, step: int, local: bool = False):
    """A checkpoint of `step`: persistent, or (local) in the emergency tier."""
    self.ledger.lap('train')
    meta = {'step': int(step), 'config': self.config_dict, 'window': self.window.to_json(),
            'skipped_total': self.monitor.skipped_total, 'goodput': self.ledger.job(),
            **ckpt_integrity.integrity_meta(self.state, self.data_iter)}
    if self.init_desc:
      meta['init_from'] = self.init_desc
    kw = {'local': True} if local else {}
    self.checkpointer.save(step, self.state, self.data_iter, meta, force=True, **kw)
    self.last_saved = step
    if jax.process_index() == 0:
      goodput_lib.write_side_file(self.workdir, meta['goodput'])
    self.ledger.lap('save')
    if jax.process_index() == 0:  # the record of the newest checkpoint's config, whole or old
      path = os.path.join(self.workdir, 'config.json')
      with open(path + '.tmp', 'w') as f:
        f.write(self.config.to_json_best_effort(indent=2))
      os.replace(path + '.tmp', path)

  def log(self, step: int, m):
    """Checks step's metrics (non-finite policy), adds them up, writes a line every log_every."""
    config, window, monitor = self.config, self.window, self.monitor
    m = jax.device_get(m)
    if monitor.check(step, m, self.last_saved):  # raises under train.nonfinite='halt'
      window.add(m)
    else:
      window.skipped += 1
    if step % config.train.log_every != 0 and step != self.end_step:
      return
    elapsed = time.time() - window.start - window.excluded
    out = {}
    if window.steps:
      out = {k: float(v) for k, v in loss_lib.summarize(
          {k: jnp.asarray(v) for k, v in window.sums.items()}, 'train').items()}
      out[metric_key('train', 'loss')] = window.loss / window.steps
      out[metric_key('train', 'grad_norm')] = float(m['grad_norm'])
    out[metric_key('train', 'lr')] = float(m['lr'])
    out[metric_key('train', 'lambda')] = float(m['lambda'])
    if 'active_depths' in m:  # the depth curriculum's a(s) at this line's step
      out[metric_key('train', 'active_depths')] = float(m['active_depths'])
    out.update(moe.log_metrics(m))  # this step's expert load, bias range, balance loss
    out[metric_key('train', 'skipped_steps')] = float(monitor.skipped_total)
    done = max(window.steps + window.skipped, 1)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    out['perf/tokens_per_sec'] = done * tokens_per_step / max(elapsed, 1e-9)
    out['perf/step_time'] = elapsed / done
    out.update(self.mfu.metrics(out['perf/tokens_per_sec']))
    inputs = (self.ledger.attempt['input'] - self._input_mark) / done  # this host's input wait
    self._input_mark = self.ledger.attempt['input']
    # Every process, same steps: the hosts' step and input times, the slowest one named.
    times, inputs = goodput_lib.host_step_times(out['perf/step_time'], inputs)
    if len(times) > 1:
      out.update(goodput_lib.spread(times, inputs))
      straggler = goodput_lib.straggler_line(step, times, inputs)
      if straggler:
        self.notify(straggler)
    self.ledger.lap('train')
    out.update(self.ledger.metrics())
    if step == self.end_step and jax.process_count() > 1:  # each host's job time, once
      for i, totals in enumerate(goodput_lib.host_totals(self.ledger.job())):
        out.update({f'perf/host{i}_job_time/{b}': v for b, v in totals.items()})
    if jax.process_index() == 0:
      goodput_lib.write_side_file(self.workdir, self.ledger.job())
    self.writer.write(step, out)
    if window.steps:
      self.progress.update(step, out['train/loss'], out['perf/tokens_per_sec'])
    window.reset()
    self.last = out

  def _disk_full_save_error(self, e: BaseException) -> ckpt_store.CheckpointError | None:
    """When a small write of the loop (metrics.jsonl, goodput.json, config.json) finds the
    disk full, an asynchronous save in flight has usually failed on it first: its error
    names the step that was lost and is the one to report."""
    if not (isinstance(e, OSError) and ckpt_store.is_disk_full(e)):
      return None
    try:
      self.checkpointer.wait()
    except ckpt_store.CheckpointError as save_error:
      return save_error
    return None

  def _before_first_step(self, guard: resilience.PreemptionGuard):
    """A signal that came during start-up (before or after the guard took over) ends the
    run here, untrained, as one at any earlier safe point does."""
    if self.startup is not None:
      self.startup.check()
    if guard.requested and guard.signum is not None:
      raise signals.StartupInterrupted(guard.signum)

  def loop(self, end_step: int, batch_hook=None) -> dict:
    """Steps until end_step (or a preemption signal), then the final eval and save."""
    config, ts, window, notify = self.config, self.ts, self.window, self.notify
    self.end_step = end_step
    step = self.start_step
    compiled = None
    pending = None  # (step, device metrics) fetched after the next step is dispatched
    error = None
    guard = resilience.PreemptionGuard(notify)  # SIGTERM / SIGINT: save at the end of the step
    profiler = profiling.StepProfiler(
        profile_window(config),
        os.path.join(self.workdir, 'profile'),
        all_processes=config.train.profile_all_processes, notify=notify)
    t = config.train
    dog = watchdog_lib.StepWatchdog(t.hang_factor, t.hang_seconds, t.hang_exit).start()
    ledger = self.ledger
    try:
      guard.install()
      ledger.lap('other')
      window.start = time.time()  # perf/: the first window starts at the first step, not at setup
      while step < end_step:
        ledger.lap('train')
        batch = next(self.data_iter)
        if batch_hook is not None:
          batch = batch_hook(step + 1, batch)
        with sharding.use_mesh(ts.mesh, ts.rules):
          gbatch = sharding.host_batch_to_global(batch, ts.mesh)
          ledger.lap('input')
          if compiled is None:  # ahead of time, so compilation is not counted as training
            t0 = time.time()
            compiled = ts.train_step.lower(self.state, gbatch).compile()
            ledger.lap('compile')
            window.excluded += time.time() - t0  # tokens/s and MFU measure training only
            self.progress.message(f'Compiled the train step in {time.time() - t0:.1f} s.')
          if step == self.start_step:
            self._before_first_step(guard)
          profiler.before_step(step + 1)  # after compiling: the trace holds steps only
          self.state, m = compiled(self.state, gbatch)
        step += 1
        if pending is not None:
          self.log(*pending)
        pending = (step, m)
        stop = guard.should_stop(step)
        profiler.after_step(step, (self.state, m), stopping=stop or step == end_step)
        want_eval = config.train.eval_every and step % config.train.eval_every == 0
        want_ckpt = config.train.checkpoint_every and step % config.train.checkpoint_every == 0
        want_log = step % config.train.log_every == 0  # perf/: a window ends at a completed step
        want_local = (t.local_checkpoint_every and step % t.local_checkpoint_every == 0
                      and not want_ckpt)
        if want_eval or want_ckpt or want_local or stop or want_log or step == end_step:
          self.log(*pending)  # a checkpoint never holds a state whose loss was not checked
          pending = None
        dog.beat(step)
        t0 = time.time()
        dog.pause()  # an eval or a save is not a stalled step
        if want_eval and step != config.train.steps and not stop:
          self.last.update(self.evaluate(step))
        if (want_ckpt or stop) and step != end_step:
          self.save(step)
        elif want_local and step != end_step:
          self.save(step, local=True)
        dog.resume()
        window.excluded += time.time() - t0
        if stop:
          notify(f'Preempted ({guard.signal_name}) at step {step}: saved a checkpoint; '
                 'rerun the same command to resume.')
          break
      dog.stop()
      if pending is not None:
        self.log(*pending)
      # The final eval comes before the final save: a kill in between redoes both.
      if self.start_step < step == config.train.steps and not guard.requested:
        self.last.update(self.evaluate(step))
      if self.last_saved != step:
        self.save(step)
      self.checkpointer.wait()  # a failed last save is an error, not a silent loss
      ledger.lap('save')
    except BaseException as e:
      error = self._disk_full_save_error(e) or e
      if error is not e:
        raise error from e
      raise
    finally:  # every closer runs; a failure surfaces unless another error is already on its way
      guard.uninstall()
      dog.stop()
      resilience.close_all(error, notify, profiler.stop, self.checkpointer.close, self.writer.close,
                           self.progress.close, getattr(self.data_iter, 'close', None))
    return self.last
