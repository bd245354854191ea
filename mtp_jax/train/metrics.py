"""Metric names and where metrics go: metrics.jsonl, TensorBoard event files, a live console line.

Every per-depth key is `metric_key(split, stat, k)`: 'train/loss_main',
'eval/acc_mtp_2', 'eval/decode_accept_mtp_1'; k None is a key without a depth
('eval/decode_tau'). Readers find the depths a log holds with `parse_key`.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import sys
import time
import uuid

import numpy as np

_KEY_RE = re.compile(r'^(\w+)/(\w+?)_(main|mtp_(\d+))$')


def depth_name(k: int) -> str:
  """'main' for the main model (depth 0), 'mtp_k' for MTP depth k."""
  return 'main' if k == 0 else f'mtp_{k}'


def depth_names(heads: int) -> list[str]:
  """depth_name of the first `heads` heads: the main one, then depths 1, 2, ..."""
  return [depth_name(k) for k in range(heads)]


def metric_key(split: str, stat: str, k: int | None = None) -> str:
  """'split/stat_main', 'split/stat_mtp_k', or 'split/stat' when depth is None."""
  return f'{split}/{stat}' if k is None else f'{split}/{stat}_{depth_name(k)}'


# Free-running decoding (evaluation.decode_metrics): mean accepted length, and per depth k
# metric_key('eval', 'decode_accept', k), P(the first k drafts of a verify step are accepted).
TAU_KEY = metric_key('eval', 'decode_tau')


def parse_key(key: str) -> tuple[str, str, int] | None:
  """(split, stat, depth) of a per-depth metric_key, else None."""
  m = _KEY_RE.match(key)
  if m is None:
    return None
  return m.group(1), m.group(2), 0 if m.group(3) == 'main' else int(m.group(4))


def key_depths(keys, split: str | tuple[str, ...], stat: str) -> list[int]:
  """The sorted depths k >= 1 for which metric_key(split, stat, k) is among `keys`."""
  splits = (split,) if isinstance(split, str) else split
  return sorted({p[2] for p in map(parse_key, keys)
                 if p is not None and p[0] in splits and p[1] == stat and p[2] > 0})


def _to_py(v):
  v = np.asarray(v)
  return v.item() if v.ndim == 0 else v.tolist()


class MetricWriter:
  """Writes one JSON object per call to metrics.jsonl and scalars to TensorBoard, and to a
  Weights & Biases run when `wandb` (config.train.wandb) names a project.

  Only the process that owns it writes (process 0 in multi-host jobs).
  """

  def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
               wandb=None, run_config: dict | None = None):
    self.enabled = enabled
    self._tb = None
    self._file = None
    self._wandb = None
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._file = open(os.path.join(workdir, 'metrics.jsonl'), 'a', buffering=1)
    # The event file is made by the first write: a run with nothing to log adds none.
    self._tb_dir = os.path.join(workdir, 'tensorboard') if tensorboard else None
    if wandb is not None and wandb.project:
      self._wandb = _wandb_run(workdir, wandb, run_config)

  def write(self, step: int, metrics: dict):
    if not self.enabled:
      return
    if self._tb is None and self._tb_dir is not None:
      # Deferred: tensorboardX pulls in protobuf; only a writing process needs it.
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(self._tb_dir)
    row = {'step': int(step)}
    row.update({k: _to_py(v) for k, v in sorted(metrics.items())})
    self._file.write(json.dumps(row) + '\n')
    if self._tb is not None:
      for k, v in row.items():
        if k != 'step' and isinstance(v, (int, float)) and math.isfinite(v):
          self._tb.add_scalar(k, v, int(step))
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if k != 'step'
                       and isinstance(v, (int, float)) and math.isfinite(v)}, step=int(step))

  def close(self):
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _wandb_run(workdir: str, settings, run_config: dict | None):
  """The workdir's Weights & Biases run: one id per workdir (WORKDIR/wandb/run_id), so a
  resumed training continues its run."""
  # Deferred: optional (the wandb extra), and only a writing process of such a run needs it.
  import wandb  # pylint: disable=g-import-not-at-top
  folder = os.path.join(workdir, 'wandb')
  os.makedirs(folder, exist_ok=True)
  id_file = os.path.join(folder, 'run_id')
  if os.path.exists(id_file):
    with open(id_file) as f:
      run_id = f.read().strip()
  else:
    run_id = uuid.uuid4().hex[:12]
    with open(id_file, 'w') as f:
      f.write(run_id + '\n')
  return wandb.init(project=settings.project, name=settings.name or os.path.basename(workdir),
                    mode=settings.mode, dir=workdir, id=run_id, resume='allow',
                    config=run_config, settings=wandb.Settings(silent=True))


class Progress:
  """A single console line rewritten in place: step, loss, tokens/s, ETA; and the messages
  printed above it. enabled: print anything (process 0 of a job); live: the step line
  (train.progress), without which the messages still print."""

  def __init__(self, total_steps: int, *, enabled: bool = True, live: bool = True,
               stream=None):
    self.total = total_steps
    self.enabled = enabled
    self.live = live
    self.stream = stream or sys.stderr
    self.tty = getattr(self.stream, 'isatty', lambda: False)()
    self.start_time = time.time()
    self.start_step = None

  def update(self, step: int, loss: float, tokens_per_sec: float, extra: str = ''):
    if not (self.enabled and self.live):
      return
    now = time.time()
    if self.start_step is None:
      self.start_step, self.start_time = step, now
    done = step - self.start_step
    rate = done / max(now - self.start_time, 1e-9)
    eta = (self.total - step) / rate if rate > 0 else float('nan')
    line = (f'step {step:>6d}/{self.total}  loss {loss:7.4f}  {tokens_per_sec:9.0f} tok/s  '
            f'ETA {_fmt_time(eta)}{("  " + extra) if extra else ""}')
    if self.tty:
      self.stream.write('\r' + line.ljust(100))
    else:
      self.stream.write(line + '\n')
    self.stream.flush()

  def message(self, text: str):
    if not self.enabled:
      return
    if self.tty and self.live:
      self.stream.write('\r' + ' ' * 100 + '\r')
    self.stream.write(text + '\n')
    self.stream.flush()

  def close(self):
    if self.enabled and self.live and self.tty:
      self.stream.write('\n')


def _fmt_time(s: float) -> str:
  if not math.isfinite(s):
    return '--:--'
  s = int(s)
  if s >= 3600:
    return f'{s // 3600:d}:{s // 60 % 60:02d}:{s % 60:02d}'
  return f'{s // 60:02d}:{s % 60:02d}'


def repair_jsonl(path: str) -> None:
  """Drops a last line cut short by a kill, so metrics.jsonl stays one JSON object a line."""
  try:
    with open(path, 'rb+') as f:
      data = f.read()
      if not data or data.endswith(b'\n'):
        return
      f.truncate(data.rfind(b'\n') + 1)
  except FileNotFoundError:
    return


# -- the console's start and end lines -------------------------------------------------------
def devices_line(devices, mesh_shape: dict, processes: int = 1) -> str:
  """'devices: 2 cpu in 1 process, mesh data 2' (axes of size 1 left out)."""
  axes = ' x '.join(f'{k} {v}' for k, v in mesh_shape.items() if v > 1) or 'one device'
  text = f'devices: {len(devices)} {devices[0].platform} in {processes} process'
  text += f'{"es" if processes > 1 else ""}, mesh {axes}'
  if devices[0].platform == 'cpu' and processes == 1:
    text += ' (--cpu_devices sets the count)'
  return text


def data_line(config) -> str:
  """'data: jsonl F.jsonl, byte tokenizer, batches of 8 x 32 tokens'."""
  d = config.data
  if d.source == 'tfds':
    where = f'tfds {d.dataset} ({d.train_split} / {d.eval_split})'
  else:
    where = f'{d.source} {d.path}'
  return (f'data: {where}, {d.tokenizer} tokenizer, batches of {d.batch_size} x '
          f'{d.seq_len} tokens')


# Units of the figures a person reads on the console (metrics.jsonl keeps bare keys).
_UNITS = (('bpb', 'bits/byte'), ('loss', 'nats/token'), ('acc', 'accuracy'),
          ('agree', 'agreement'), ('decode_tau', 'tokens/step'))


def unit_of(key: str) -> str:
  stat = key.split('/', 1)[-1]
  for prefix, unit in _UNITS:
    if stat.startswith(prefix):
      return unit
  return ''


def eval_line(step: int, metrics: dict) -> str:
  """'eval @ 40: loss main 3.21 mtp_1 3.90 nats/token | bpb main 1.52 ... bits per byte'."""
  groups = {}
  for k, v in metrics.items():
    parsed = parse_key(k)
    if k == TAU_KEY:
      groups.setdefault('tau', []).append(f'{v:.3f}')
    elif parsed is not None and parsed[1] in ('loss', 'bpb'):
      groups.setdefault(parsed[1], []).append(f'{depth_name(parsed[2])} {v:.4f}')
  units = {'loss': 'nats/token', 'bpb': 'bits per byte', 'tau': 'tokens per verify step'}
  return f'eval @ {step}: ' + ' | '.join(
      f'{stat} {" ".join(groups[stat])} {unit}' for stat, unit in units.items() if stat in groups)


def _read_rows(workdir: str) -> list[dict]:
  rows = []
  try:
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      for line in f:
        try:
          rows.append(json.loads(line))
        except ValueError:
          continue
  except OSError:
    pass
  return rows


# The decode line's new tokens when the trained sequence has room for them.
SUGGESTED_NEW_TOKENS = 128


def command(name: str) -> str:
  """How a console script installed beside this interpreter runs from the current folder:
  its bare name when PATH finds that one (an activated venv), else its path
  (`.venv/bin/mtp-decode`); the bare name when it is not installed here."""
  bindir = os.path.dirname(sys.executable)
  mine = os.path.join(bindir, name)
  if not os.path.isfile(mine):
    return name
  found = shutil.which(name)
  if found and os.path.realpath(found) == os.path.realpath(mine):
    return name
  rel = os.path.relpath(mine)
  return shlex.quote(mine if rel.startswith('..') else rel)


def train_from_command(workdir: str, new_workdir: str, flags=()) -> str:
  """The training command that continues from a trained workdir: its saved config.json as
  the config, into `new_workdir`, with `flags` ('--init_from ...', '--config.K=V'); a
  checkpoint location the saved run named is reset, so the new run writes its own."""
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      train = json.load(f).get('train', {})
  except (OSError, ValueError, AttributeError):
    train = {}
  flags = list(flags) + [f'--config.train.{k}=' for k in ('checkpoint_dir', 'local_checkpoint_dir')
                         if train.get(k)]
  return ' '.join([command('mtp-train'), '--config',
                   shlex.quote(os.path.join(workdir, 'config.json')), '--workdir',
                   shlex.quote(new_workdir), *(shlex.quote(f) for f in flags)])


def final_block(workdir: str, step: int, checkpoint: int | None, prompt: str = '',
                room: int | None = None) -> str:
  """What a finished run says last: where it is, its last and best figures, what to run next
  (prompt: the decode line's, from the run's own data; '' reads prompts from a file; room:
  the positions a decode has after that prompt, data.seq_len minus its tokens)."""
  rows = _read_rows(workdir)
  lines = [f'done: step {step} in {workdir}'
           + (f' (checkpoint {checkpoint})' if checkpoint is not None else '')]
  last_train = next((r for r in reversed(rows) if 'train/loss' in r), None)
  evals = [r for r in rows if any(k.startswith('eval/') for k in r)]
  if last_train is not None:
    text = (f'  last train loss {last_train["train/loss"]:.4f} nats/token '
            f'(step {last_train["step"]})')
    if 'perf/tokens_per_sec' in last_train:
      text += f', {last_train["perf/tokens_per_sec"]:.0f} tokens/s'
    if 'perf/mfu' in last_train:
      text += f', MFU {last_train["perf/mfu"]:.2f}'
    lines.append(text)
  for key, name in ((metric_key('eval', 'bpb', 0), 'bits per byte'),
                    (metric_key('eval', 'loss', 0), 'loss (nats/token)')):
    have = [r for r in evals if key in r]
    if have:
      best = min(have, key=lambda r: r[key])
      lines.append(f'  eval {name}, main model: last {have[-1][key]:.4f} (step '
                   f'{have[-1]["step"]}), best {best[key]:.4f} (step {best["step"]})')
  tau = [r for r in evals if TAU_KEY in r]
  if tau:
    lines.append(f'  eval decode tau: last {tau[-1][TAU_KEY]:.3f} tokens per verify step')
  quoted = _quote(workdir)
  new_tokens = SUGGESTED_NEW_TOKENS if room is None else min(room, SUGGESTED_NEW_TOKENS)
  lines += ['next:',
            f'  {command("mtp-decode")} --workdir {quoted} --mode compare '
            + (f'--prompt {_quote(prompt)}' if prompt else '--prompts_file prompts.txt')
            + f' --max_new_tokens {new_tokens}',
            f'  {command("mtp-eval")} --workdir {quoted}',
            f'  {command("tensorboard")} --logdir '
            f'{_quote(os.path.join(workdir, "tensorboard"))}']
  return '\n'.join(lines)


def _quote(path: str) -> str:
  return shlex.quote(path)
