"""What every benchmark script shares: arguments, the lock, provenance, child processes, JSON.

A script builds its parser with `parser(NAME, __doc__)`, which adds
  --out PATH   where the JSON goes (default runs/benchmarks/NAME.json, never a committed
               file; `--out benchmarks/results/NAME.json` replaces the committed result)
  --smoke      the smallest run that exercises the script's code path (tiny shapes, one
               round, no lock); its numbers mean nothing, its keys are the real run's
  --lock PATH  the file every timed run holds with flock while it measures (default
               runs/benchmarks/bench.lock), so two benchmarks never time each other
then calls `run = start(args, NAME)` before timing and `write(run, result)` at the end.
The JSON written is one object: the benchmark's own figures under "result", and what
they were measured on beside them: the commit (with a flag for local changes), the
machine (CPU model, cores, platform, jax), the load average (`uptime`) at start and
end, the host's cached CPU peak that MFU divides by, the command line and the date.

This module imports JAX only inside functions: train_throughput.py configures the
allocator before JAX starts its threads.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import platform
import shlex
import subprocess
import sys

from mtp_jax import cli  # argparse and absl only: no JAX
from mtp_jax.runtime import machine as machine_lib  # standard library only

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS_DIR = os.path.join('runs', 'benchmarks')  # relative to the checkout; gitignored
RESULTS_DIR = os.path.join('benchmarks', 'results')  # the committed, cited results
LOCK = os.path.join(RUNS_DIR, 'bench.lock')
RESULT_PREFIX = 'RESULT '  # a child process's one line of JSON


def default_out(name: str) -> str:
  return os.path.join(REPO, RUNS_DIR, f'{name}.json')


def parser(name: str, doc: str) -> cli.ArgumentParser:
  """The project's ArgumentParser (bad flags: one `error:` line, exit 2) with the shared
  --out, --smoke and --lock."""
  p = cli.ArgumentParser(description=(doc or name).strip().splitlines()[0])
  p.add_argument('--out', default=default_out(name),
                 help=f'JSON output (default {RUNS_DIR}/{name}.json; the committed result is '
                      f'{RESULTS_DIR}/{name}.json and is only written when named here)')
  p.add_argument('--smoke', action='store_true',
                 help='the smallest run of every code path (tiny shapes, one round, no '
                      'lock): for tests, its figures mean nothing')
  p.add_argument('--lock', default=os.path.join(REPO, LOCK),
                 help='flock held while measuring, shared by every benchmark (empty: none)')
  return p


def load_average() -> list[float]:
  """`uptime`'s load average: 1, 5 and 15 minutes."""
  return [round(x, 2) for x in os.getloadavg()]


cpu_flags = machine_lib.cpu_flags


def machine() -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  return {'cpu': machine_lib.cpu_model(), 'cores': machine_lib.usable_cores(),
          'vector_flags': cpu_flags(),
          'platform': platform.platform(), 'python': platform.python_version(),
          'jax': jax.__version__, 'backend': jax.default_backend()}


def commit() -> dict:
  """The checkout's commit and whether tracked files differ from it."""
  def git(*args):
    return subprocess.run(['git', '-C', REPO, *args], capture_output=True, text=True,
                          check=False).stdout.strip()
  head = git('rev-parse', '--short=12', 'HEAD')
  if not head:
    return {'commit': None, 'local_changes': None}
  return {'commit': head, 'local_changes': bool(git('status', '--porcelain', '-uno'))}


def peak() -> dict | None:
  """The host's cached CPU peak (mtp_jax.runtime.peak: the best f32 2048^2 / 4096^2 matmul
  probe taken here), which every MFU divides by; probes once if none is cached."""
  import jax  # pylint: disable=import-outside-toplevel
  if jax.default_backend() != 'cpu':
    return None
  from mtp_jax.runtime import peak as peak_lib  # pylint: disable=import-outside-toplevel
  p = dict(peak_lib.cpu_peak())
  return {'gflops': p['flops'] / 1e9, 'date': p.get('date'),
          'load_average': p.get('load_average'), 'source': p.get('source')}


class Run:
  """One benchmark run: its provenance and the lock it holds."""

  def __init__(self, args, name: str, argv=None, script: str = ''):
    self.name, self.args = name, args
    self.argv = list(sys.argv[1:] if argv is None else argv)
    self.script = script or f'benchmarks/{name}.py'
    self.smoke = bool(getattr(args, 'smoke', False))
    self.note = ''  # what a reader of the result file needs to know (how to read it)
    self._lock = None
    lock = getattr(args, 'lock', '')
    if lock and not self.smoke:
      os.makedirs(os.path.dirname(os.path.abspath(lock)), exist_ok=True)
      self._lock = open(lock, 'a')  # pylint: disable=consider-using-with
      fcntl.flock(self._lock, fcntl.LOCK_EX)  # waits for any other benchmark to finish
    self.started = datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')
    self.load_start = load_average()

  def envelope(self) -> dict:
    argv = [a.replace(REPO + os.sep, '') for a in self.argv]
    return {'benchmark': self.name,
            'command': shlex.join(['python', self.script, *argv]),  # pastes into a shell
            **commit(), 'machine': machine(),
            'load_average': {'start': self.load_start, 'end': load_average()},
            'peak': peak(), 'date': self.started, 'smoke': self.smoke,
            **({'note': self.note} if self.note else {})}

  def release(self):
    if self._lock is not None:
      fcntl.flock(self._lock, fcntl.LOCK_UN)
      self._lock.close()
      self._lock = None


def start(args, name: str, argv=None, script: str = '') -> Run:
  """Takes the lock (unless --smoke) and notes the start: call before timing anything.
  argv: the script's arguments (default sys.argv[1:]), recorded as the command."""
  return Run(args, name, argv, script)


def write(run: Run, result: dict, out: str | None = None) -> dict:
  """Writes {provenance..., 'result': result} to `out` (default --out) and releases the
  lock; returns the object written."""
  doc = run.envelope() | {'result': result}
  run.release()
  return write_doc(doc, out or run.args.out)


def write_doc(doc: dict, path: str) -> dict:
  """Writes a result object to `path` atomically; returns it."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f'{path}.{os.getpid()}.tmp'
  with open(tmp, 'w') as f:
    json.dump(doc, f, indent=1)
    f.write('\n')
  os.replace(tmp, path)
  print('wrote', os.path.relpath(path), file=sys.stderr)
  return doc


def run_child(code: str, env: dict | None = None, timeout: float | None = None) -> dict:
  """Runs `code` in a fresh Python process (process-wide settings such as the allocator or
  XLA flags must be made before JAX starts) and returns the JSON of its last line that
  starts with RESULT_PREFIX; SystemExit with the child's stderr tail if it fails."""
  env = dict(os.environ if env is None else env)
  env['PYTHONPATH'] = os.pathsep.join(
      [REPO, os.path.join(REPO, 'benchmarks')] + ([env['PYTHONPATH']] if env.get('PYTHONPATH')
                                                  else []))
  proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
  if proc.returncode or not lines:
    tail = '\n'.join(proc.stderr.strip().splitlines()[-15:])
    raise SystemExit(f'error: child process failed (exit {proc.returncode}):\n{tail}')
  return json.loads(lines[-1][len(RESULT_PREFIX):])


def emit(result: dict) -> None:
  """A child process's answer to run_child."""
  print(RESULT_PREFIX + json.dumps(result), flush=True)


def committed(path: str) -> bool:
  """Whether `path` is a file git tracks in this checkout."""
  rel = os.path.relpath(os.path.abspath(path), REPO)
  proc = subprocess.run(['git', '-C', REPO, 'ls-files', '--error-unmatch', rel],
                        capture_output=True, text=True, check=False)
  return proc.returncode == 0


def median(xs):
  xs = sorted(xs)
  n = len(xs)
  return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def names_flag(p, text: str, allowed, flag: str) -> list[str]:
  """The comma-separated names of a flag's value, each one of `allowed`; p.error (exit 2)
  naming the allowed ones otherwise, or when there are none."""
  names = [n for n in text.split(',') if n]
  bad = [n for n in names if n not in allowed]
  if bad or not names:
    p.error(f'{flag} must name some of {", ".join(allowed)}, got {bad or "nothing"}')
  return names
