"""The start of a run, before its state is built: the config resolved and checked, the
workdir's lock, the checks that the run can start (or resume), its checkpointer, and
`InitSource`, what `--init_from` starts it from.

Everything here fails before anything compiles, and a failed start leaves nothing behind:
`Start` is a context whose one `contextlib.ExitStack` undoes what it did (the files this run
added, the checkpointer, the lock) when the start, or the run inside it, fails before its
first checkpoint.
"""
from __future__ import annotations

import abc
import contextlib
import json
import os
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

import mtp_jax.train.evaluation as evaluation
import mtp_jax.train.metrics as metrics_lib
import mtp_jax.train.resilience as resilience
from mtp_jax.checkpoint import compat as ckpt_compat
from mtp_jax.checkpoint import partial as ckpt_partial
from mtp_jax.checkpoint import reader as ckpt_reader
from mtp_jax.checkpoint import store as ckpt_store
from mtp_jax.config.validation import validate
from mtp_jax.data import checks as data_checks
from mtp_jax.data import tokenizers
from mtp_jax.errors import ConfigError
from mtp_jax.interop import hf
from mtp_jax.model.args import ModelArgs
from mtp_jax.runtime import compile_cache
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train_state.init_from import InitFrom
from mtp_jax.train_state.state import abstract_train_state


# -- what --init_from starts a run from -------------------------------------------------
class InitSource(abc.ABC):
  """A parsed --init_from (InitFrom) and what a run does with it; one subclass per kind."""

  def __init__(self, init_from: InitFrom):
    self.init_from = init_from
    self.path = init_from.path

  def __str__(self) -> str:
    return str(self.init_from)

  def apply_to_config(self, config) -> list[str]:
    """What the source sets in `config` before it is checked, as 'field: old -> new'."""
    del config
    return []

  @abc.abstractmethod
  def check(self, config, config_dict: dict) -> None:
    """ConfigError / CheckpointError / InteropError unless the source fits `config`; reads
    no weight and compiles nothing."""

  @abc.abstractmethod
  def load(self, config, config_dict: dict, state, abstract_state, notify):
    """(`state` with the source's weights where it has them, description)."""

  def describe(self, changes: list[str]) -> str:
    """The line that reports apply_to_config's changes."""
    return f'--init_from {self} sets ' + '; '.join(changes)


class HFSource(InitSource):
  """`hf:DIR`: a local Hugging Face directory; its config.json and tokenizer define the
  model (also on resume, so the same command resumes)."""

  def apply_to_config(self, config) -> list[str]:
    return hf.apply_to_config(config, self.path)

  def check(self, config, config_dict: dict) -> None:
    del config_dict  # every tensor's name, shape and dtype, none read
    hf.check_weights(self.path, ModelArgs.from_config(config))

  def load(self, config, config_dict: dict, state, abstract_state, notify):
    del config_dict, abstract_state
    return hf.init_state(self.path, config, state, notify)


class CheckpointSource(InitSource):
  """A workdir, its checkpoints/ directory or one step directory of this project: its trunk,
  embedding and head (and the MTP depths that match) start the run."""

  def check(self, config, config_dict: dict) -> None:
    # Quiet: load reports a broken step it skips once.
    ckpt_partial.check_init_from(self.path, config, config_dict, notify=lambda text: None)

  def load(self, config, config_dict: dict, state, abstract_state, notify):
    return ckpt_partial.init_from(self.path, config, config_dict, state, abstract_state,
                                  notify)


SOURCES = {'hf': HFSource, 'checkpoint': CheckpointSource}


def init_source(value: str | InitFrom | None) -> InitSource | None:
  """The source of a --init_from value (InitFrom.parse's one parse); None for none."""
  init_from = InitFrom.parse(value)
  return None if init_from is None else SOURCES[init_from.kind](init_from)


def resolve_config(config, source: InitSource | None, num_devices: int) -> list[str]:
  """The config as the run trains it, checked: the source's changes (returned), the vocab
  size from the tokenizer, 'auto' dtype as this host's choice for training (config.json
  keeps the request beside it, model.dtype_requested, so a decode of the run resolves
  'auto' for decoding: runtime/peak.py resolve_model_dtype)."""
  changes = source.apply_to_config(config) if source is not None else []
  tokenizers.resolve_vocab_size(config)
  validate(config, num_devices)
  peak_lib.resolve_model_dtype(config, 'train')
  return changes


# -- the start ----------------------------------------------------------------------------
class Notifier:
  """Events that must be seen even without the progress line (process 0 only)."""

  def __init__(self, progress: metrics_lib.Progress, is_main: bool):
    self.progress, self.is_main = progress, is_main

  def __call__(self, text: str):
    if not self.is_main:
      return
    if self.progress.enabled:
      self.progress.message(text)
    else:
      print(text, file=sys.stderr, flush=True)


class Start:
  """`with Start(...) as start:` a run's start, checked; the run goes inside the `with`.

  Entering resolves and checks the config, the data and --init_from, takes the workdir's
  lock, checks that the run can start (or resume) and opens its checkpointer, in that
  order, all before anything compiles. Leaving on an error (there, or in the run inside)
  undoes the start: the files this run added go (kept once a checkpoint exists), the
  checkpointer closes unless the loop took it over (hand_over), the lock is released.
  Leaving normally releases the lock.
  """

  def __init__(self, config, workdir: str, devices, init_from: str | InitFrom | None,
               new_data: bool, startup):
    self.config, self.workdir, self.devices = config, workdir, devices
    self.source = init_source(init_from)
    self.new_data, self.startup = new_data, startup
    self.is_main = jax.process_index() == 0
    self._stack = None
    self._loop_closes = False

  def __enter__(self) -> Start:
    with contextlib.ExitStack() as stack:
      self._set_up(stack)
      self._stack = stack.pop_all()
    return self

  def __exit__(self, *exc) -> bool:
    return self._stack.__exit__(*exc)

  def hand_over(self) -> ckpt_store.Checkpointer:
    """The checkpointer, from now on closed by the loop (which closes it in any case)."""
    self._loop_closes = True
    return self.checkpointer

  def _set_up(self, stack: contextlib.ExitStack) -> None:
    config, workdir, startup = self.config, self.workdir, self.startup
    startup.check()
    changes = resolve_config(config, self.source, len(self.devices))
    data_checks.validate_data(config, jax.process_count())
    data_checks.check_document_lengths(config)
    self.tokenizer = tokenizers.get_tokenizer(config.data)
    self.progress = metrics_lib.Progress(config.train.steps, enabled=self.is_main,
                                         live=config.train.progress)
    notify = self.notify = Notifier(self.progress, self.is_main)
    startup.check()
    # Before anything compiles: a rerun of this config loads its programs from the cache.
    compile_cache.enable(config.train.compilation_cache_dir, notify)
    before = resilience.workdir_entries(workdir)
    created = resilience.check_workdir(workdir)
    stack.callback(lock_workdir(workdir, self.is_main, notify).release)
    self.config_dict = json.loads(config.to_json_best_effort())
    # train.checkpoint_dir: a URL (gs://...) goes to orbax untouched; the workdir stays local.
    checkpoints_dir = (ckpt_store.location(config.train.checkpoint_dir)
                       if config.train.checkpoint_dir
                       else os.path.join(workdir, 'checkpoints'))
    self.local_dir = os.path.abspath(os.path.expanduser(
        config.train.local_checkpoint_dir or os.path.join(workdir, 'local_checkpoints')))

    def undo_failed_start(exc_type, exc, tb):  # before the first checkpoint: nothing is left
      del exc, tb
      if exc_type is not None and self.is_main:
        resilience.remove_failed_start(workdir, created, before,
                                       [checkpoints_dir, self.local_dir])

    stack.push(undo_failed_start)
    startup.check()
    self.data_changes = check_resumable(config, self.config_dict,
                                        ckpt_reader.CheckpointReader(checkpoints_dir),
                                        self.source, self.new_data)
    self.decode_prompts = evaluation.training_prompts(config, self.tokenizer)  # [] when off
    # only once the run can start: a refused one prints its error alone
    notify(peak_lib.dtype_line(config, 'train'))
    if changes:
      notify(self.source.describe(changes))
    # Only under the lock: the writer's start-up removes incomplete saves.
    self.checkpointer = _open_checkpointer(config, checkpoints_dir, self.local_dir)

    def close_checkpointer(exc_type, exc, tb):
      del exc, tb
      if exc_type is not None and not self._loop_closes:
        self.checkpointer.close()

    stack.push(close_checkpointer)
    if self.checkpointer.incomplete:
      notify(f'Ignoring incomplete checkpoint save(s) left by an interrupted run: '
             f'{", ".join(self.checkpointer.incomplete)} (removed).')
    if self.is_main:  # the only writer of metrics.jsonl
      metrics_lib.repair_jsonl(os.path.join(workdir, 'metrics.jsonl'))
    startup.check()


def _open_checkpointer(config, checkpoints_dir: str, local_dir: str):
  """The run's checkpointer: persistent, with the emergency tier (each process's own
  shards) when train.local_checkpoint_every is set."""
  checkpointer = ckpt_store.Checkpointer(checkpoints_dir, max_to_keep=config.train.max_to_keep,
                                         async_save=config.train.async_checkpoint)
  if not config.train.local_checkpoint_every:
    return checkpointer
  own = (local_dir if jax.process_count() == 1
         else os.path.join(local_dir, f'process_{jax.process_index()}'))
  return ckpt_store.TieredCheckpointer(checkpointer, ckpt_store.Checkpointer(
      own, max_to_keep=2, async_save=config.train.async_checkpoint, per_process=True))


def lock_workdir(workdir: str, is_main: bool, notify) -> resilience.WorkdirLock:
  """The workdir's writer lock, taken by process 0 for the whole job; WorkdirError (every
  process) when another trainer holds it."""
  lock = resilience.WorkdirLock(workdir, notify)
  error = None
  if is_main:
    try:
      lock.acquire()
    except resilience.WorkdirError as e:
      error = e
  if jax.process_count() > 1:  # every process stops, not only the one that was refused
    refused = multihost_utils.broadcast_one_to_all(np.int32(error is not None))
    if int(refused) and error is None:
      error = resilience.WorkdirError(f'--workdir {workdir!r} is being trained by another job '
                                      '(process 0 was refused its lock)')
  if error is not None:
    raise error
  return lock


def check_resumable(config, config_dict, reader: ckpt_reader.CheckpointReader,
                    source: InitSource | None, new_data: bool) -> list[str]:
  """ConfigError / WorkdirError, before anything compiles, for a run that cannot start:
  a checkpoint of another config (or data stream, without new_data), an unusable
  --init_from, a frozen random trunk, or no disk space for one checkpoint. Returns the
  data fields that differ from the checkpoint's (accepted under new_data)."""
  steps_saved = reader.steps()
  data_changes = []
  for s in reversed(steps_saved):
    try:
      meta = reader.read_meta(s)
    except Exception:  # pylint: disable=broad-except
      continue  # unreadable: restore_latest_good reports it and falls back
    data_changes = ckpt_compat.check_compatible(meta.get('config', {}), config_dict,
                                                reader.directory, new_data)
    break
  if source is not None and not steps_saved:
    source.check(config, config_dict)
  if config.model.mtp.freeze_trunk and not (source is not None or steps_saved):
    raise ConfigError(
        'model.mtp.freeze_trunk would train MTP modules on a randomly initialised, frozen '
        'trunk: give --init_from=<a trained workdir or checkpoint>')
  if not ckpt_store.is_url(reader.directory):  # an object store has no free-space figure
    resilience.check_disk_space(resilience.existing_parent(reader.directory),
                                resilience.checkpoint_bytes_estimate(
                                    abstract_train_state(config)))
  return data_changes
