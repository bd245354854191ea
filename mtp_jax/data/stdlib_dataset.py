"""TFDS access: the `python_stdlib` builder and `data_source()` for any prepared dataset.

`python_stdlib` is written as ArrayRecord and read with `tfds.data_source`, so no
TensorFlow is needed. Its config name carries the interpreter version, the
validation percent and a fingerprint of the file list (e.g.
`cpython3_11_7-val5-1a2b3c4d5e`), so each Python gets its own prepared copy.
Other datasets (c4, lm1b, ...) prepared as array_record are read by name through
the same `tfds.data_source` call; they are never downloaded from here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import tensorflow_datasets as tfds
from tensorflow_datasets.core.utils import tqdm_utils

import mtp_jax.data.corpus as corpus
import mtp_jax.data.user_data as user_data
from mtp_jax.errors import ConfigError

STDLIB_NAME = 'python_stdlib'
DATA_DIR_ENV = 'MTP_JAX_DATA_DIR'
DEFAULT_DATA_DIR = '~/.cache/mtp_jax/tensorflow_datasets'


def resolve_data_dir(data_dir: str = '') -> str:
  """data.data_dir, else $MTP_JAX_DATA_DIR, else ~/.cache/mtp_jax/tensorflow_datasets."""
  d = data_dir or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR
  return os.path.abspath(os.path.expanduser(d))


@dataclasses.dataclass(eq=False)
class StdlibConfig(tfds.core.BuilderConfig):
  """One corpus root + split rule; made at run time by `stdlib_config()`."""
  root: str = ''
  validation_percent: float = 5


def stdlib_config(corpus_dir: str = '', validation_percent: float = 5) -> StdlibConfig:
  """The builder config for this interpreter's corpus (ConfigError if it is empty)."""
  root = corpus.resolve_root(corpus_dir)
  paths = corpus.list_files(root)
  pct = f'{validation_percent:g}'.replace('.', 'p')
  name = f'{corpus.interpreter_tag()}-val{pct}-{corpus.fingerprint(root, paths)}'
  return StdlibConfig(name=name, version=PythonStdlib.VERSION, root=root,
                      validation_percent=validation_percent,
                      description=f'.py files under {root}')


class PythonStdlib(tfds.core.GeneratorBasedBuilder):
  """The `.py` files of a Python standard library, split by path hash."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Text and relative path of each .py file.'}
  # No static configs: the config depends on the running interpreter (stdlib_config).

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description='Python standard library source files (invalid UTF-8 replaced).',
        features=tfds.features.FeaturesDict({
            'text': tfds.features.Text(),
            'path': tfds.features.Text(),
        }),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is local
    cfg = self.builder_config
    paths = corpus.split_files(corpus.list_files(cfg.root), cfg.validation_percent)
    return {split: self._generate_examples(paths[split]) for split in corpus.SPLITS}

  def _generate_examples(self, paths: Sequence[str]):
    stats = corpus.ReadStats()
    for relpath, text in corpus.iter_documents(self.builder_config.root, paths, stats):
      yield relpath, {'text': text, 'path': relpath}
    skipped = stats.empty + stats.binary + stats.unreadable
    logging.info('python_stdlib: %d files (%d with replaced bytes), skipped %d '
                 '(empty %d, binary %d, unreadable %d)', stats.documents, stats.replaced,
                 skipped, stats.empty, stats.binary, stats.unreadable)


@contextlib.contextmanager
def _no_progress_bars():
  """Hides TFDS's tqdm bars during the build, restoring the caller's setting."""
  previous = getattr(tqdm_utils, '_active', True)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(previous)


@contextlib.contextmanager
def _file_lock(path: str):
  """An exclusive advisory lock; released when the process dies, so never stale."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'a+') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare_stdlib(*, data_dir: str = '', corpus_dir: str = '',
                   validation_percent: float = 5) -> tuple[str, float]:
  """Builds python_stdlib once (safe across concurrent processes); returns (tfds name, seconds).

  Seconds is 0.0 when the dataset was already prepared.
  """
  data_dir = resolve_data_dir(data_dir)
  cfg = stdlib_config(corpus_dir, validation_percent)
  try:
    os.makedirs(data_dir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f'data.data_dir {data_dir!r} cannot be created: {e}') from e
  if not os.access(data_dir, os.W_OK):
    raise ConfigError(f'data.data_dir {data_dir!r} is not writable (python_stdlib is built there)')
  name = f'{STDLIB_NAME}/{cfg.name}'
  done_dir = os.path.join(data_dir, STDLIB_NAME, cfg.name, str(PythonStdlib.VERSION))
  if os.path.exists(os.path.join(done_dir, 'dataset_info.json')):
    return name, 0.0
  # TFDS writes into a temp dir and renames it; the lock keeps a second process
  # from building the same dataset alongside (it waits, then finds it done).
  with _file_lock(os.path.join(data_dir, f'.{STDLIB_NAME}-{cfg.name}.lock')):
    if os.path.exists(os.path.join(done_dir, 'dataset_info.json')):
      return name, 0.0
    start = time.perf_counter()
    builder = PythonStdlib(config=cfg, data_dir=data_dir, file_format='array_record')
    with _no_progress_bars():
      builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
          try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP))
    seconds = time.perf_counter() - start
  logging.info('Prepared %s in %s in %.1f s', name, data_dir, seconds)
  return name, seconds


def resolve_dataset_name(data_config) -> str:
  """The TFDS name to read: python_stdlib is prepared on first use, others must exist."""
  if data_config.dataset == STDLIB_NAME:
    name, _ = prepare_stdlib(data_dir=data_config.data_dir,
                             corpus_dir=data_config.corpus_dir,
                             validation_percent=data_config.validation_percent)
    return name
  return data_config.dataset


def check_text_key(data_config, record: dict) -> None:
  """ConfigError when data.text_key is not a feature of a record of the data set."""
  if data_config.text_key not in record:
    raise ConfigError(f'data.text_key {data_config.text_key!r} is not a feature of '
                      f'data.dataset {data_config.dataset!r} (features: {sorted(record)})')


def data_source(data_config, split: str) -> Any:
  """A random-access source (len, [i]) of dicts for one split; ConfigError if unavailable.

  Reads through `tfds.data_source(name, data_dir=..., download=False)`: nothing
  is ever downloaded from here. data.source other than tfds: user_data's readers.
  """
  if user_data.is_user_source(data_config):
    return user_data.data_source(data_config, split)
  name = resolve_dataset_name(data_config)
  data_dir = resolve_data_dir(data_config.data_dir)
  where = f'data.dataset {data_config.dataset!r} in data.data_dir {data_dir!r}'
  how = (f'prepare it with `tfds build {data_config.dataset} --file_format=array_record '
         f'--data_dir={data_dir}`, or set data.dataset / data.data_dir')
  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ConfigError(f'{where}: no such TFDS dataset (neither registered nor on disk)') from e
  except Exception as e:  # a corrupt or partial directory
    raise ConfigError(f'{where} cannot be opened: {type(e).__name__}: {str(e)[:300]}') from e
  if not builder.is_prepared():
    raise ConfigError(f'{where} is not prepared; {how}')
  fmt = builder.info.file_format
  if fmt is None or fmt.value not in ('array_record', 'parquet'):
    raise ConfigError(f'{where} is stored as {fmt}, which has no random access '
                      f'(and would need TensorFlow); {how}')
  if split.split('[')[0] not in builder.info.splits:  # 'train[:90%]' slices are fine
    raise ConfigError(f'{where} has no split {split!r} (data.train_split / data.eval_split); '
                      f'it has {sorted(builder.info.splits)}')
  source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  if len(source) == 0:
    raise ConfigError(f'{where}: split {split!r} is empty')
  return source
