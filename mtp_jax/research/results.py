"""A sweep's per-run results: one JSON file per group (`OUT/<group>.json`, a list of runs).

Standard library only, so the figures and tables read results without importing JAX. A
result is added by rewriting the group's file through a temporary and a rename: a sweep
killed mid-write leaves the previous, complete file, never half a result that looks done.
"""

from __future__ import annotations

import json
import os


def _order(run: dict) -> tuple:
  return str(run.get('variant')), int(run.get('seed', 0))


def results_path(out_dir: str, group: str) -> str:
  return os.path.join(out_dir, group + '.json')


def load_results(out_dir: str, group: str) -> list[dict]:
  """The group's finished runs, sorted by variant and seed ([] when there are none)."""
  path = results_path(out_dir, group)
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    runs = json.load(f)
  if not isinstance(runs, list):
    raise ValueError(f'{path}: expected a list of run results, got {type(runs).__name__}')
  return sorted(runs, key=_order)


def find_result(out_dir: str, group: str, variant: str, seed: int) -> dict | None:
  for r in load_results(out_dir, group):
    if r.get('variant') == variant and r.get('seed') == seed:
      return r
  return None


def save_result(out_dir: str, group: str, result: dict) -> str:
  """Adds `result` to its group's file (replacing a run of the same variant and seed)."""
  runs = [r for r in load_results(out_dir, group) if _order(r) != _order(result)]
  runs = sorted(runs + [result], key=_order)
  path = results_path(out_dir, group)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + '.tmp'
  with open(tmp, 'w') as f:
    json.dump(runs, f, indent=1)
    f.write('\n')
  os.replace(tmp, path)
  return path


def corpus_fingerprint(r: dict, corpus: str) -> str | None:
  """The fingerprint of the corpus ('heldout' or 'stdlib_val') a run was scored on (None:
  not recorded). The held-out corpus is built from the installed packages and the stdlib
  validation split from the interpreter's standard library, so either can differ between
  machines."""
  return ((r.get('evaluation') or {}).get(corpus) or {}).get('fingerprint')


def same_corpus(a: dict, b: dict, corpus: str) -> bool:
  """Whether runs a and b were scored on the same `corpus`: only then is a difference of
  their figures on it a pair. A run that recorded no fingerprint (made before runs recorded
  it) cannot be shown to differ, so it pairs."""
  fa, fb = corpus_fingerprint(a, corpus), corpus_fingerprint(b, corpus)
  return fa is None or fb is None or fa == fb
