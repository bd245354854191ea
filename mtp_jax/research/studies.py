"""Where the sweep's studies are defined: the research config files of the checkout
(configs/ablation.py, induction.py, induction_names.py, induction_bpe.py, drafter.py) and the
decode-speed benchmark's result, read when first asked for, never on import.

`studies.ABLATION` (and INDUCTION, NAMES, BPE_NAMES, DRAFTER, CONFIGS) loads its config
module on first use and keeps it; `group_configs()` is every group's module, as the tables
take them.
"""
from __future__ import annotations

import functools
import json
import os

from mtp_jax import config_files

# The checkout this package is installed from (pip install -e .): configs/ lives there.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GROUPS = ('lm', 'induction', 'sized', 'names', 'bpe_names', 'drafter', 'compute')
DEFAULT_GROUPS = ('lm', 'induction')
# group -> its config file under configs/ (the sized sweep is configs/ablation.py's ',decay')
GROUP_FILES = {'lm': 'ablation', 'sized': 'ablation', 'compute': 'ablation',
               'induction': 'induction',
               'names': 'induction_names', 'bpe_names': 'induction_bpe', 'drafter': 'drafter'}
_NAMED = {'ABLATION': 'ablation', 'INDUCTION': 'induction', 'NAMES': 'induction_names',
          'BPE_NAMES': 'induction_bpe', 'DRAFTER': 'drafter'}
# benchmarks/decode_speed.py's current result, relative to the checkout
DECODE_SPEED = os.path.join('benchmarks', 'results', 'decode_speed.json')
D768 = {'d_model': 768, 'n_layers': 12}


@functools.cache
def load_config_module(name: str, repo: str = REPO):
  """configs/<name>.py of the checkout `repo`, loaded once."""
  return config_files.load_module(os.path.join(repo, 'configs', f'{name}.py'))


def group_configs(repo: str = REPO) -> dict:
  """{group: its config module} for every group but `sized` and `compute` (both
  configs/ablation.py, as `lm`)."""
  return {g: load_config_module(f, repo) for g, f in GROUP_FILES.items()
          if g not in ('sized', 'compute')}


def __getattr__(name: str):
  if name in _NAMED:
    return load_config_module(_NAMED[name])
  if name == 'CONFIGS':
    return group_configs()
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def d768_iteration_costs(path: str | None = None) -> dict | None:
  """The cost of one verify iteration relative to one AR step of the d 768, 12-layer model,
  as benchmarks/decode_speed.py measured it at batch 1 in float32 with every draft taken:
  {'cost_ratio': {'T<t>': {'<drafts>': ratio}}, 'command', 'commit', 'date', 'machine'}
  from the first such run; None when the file or such a run is missing. A drafter's tau
  over this ratio projects its speed-up onto that model (the tables' `projected_speedup_*`):
  a projection, not a measurement of the drafter's own model."""
  path = os.path.join(REPO, DECODE_SPEED) if path is None else path
  if not os.path.exists(path):
    return None
  with open(path) as f:
    bench = json.load(f)
  for run in bench.get('runs', []):
    res = run.get('result', {})
    if any(res.get('model', {}).get(k) != v for k, v in D768.items()):
      continue
    ratios = {}
    for row in res.get('results', []):
      if (row['batch_size'], row['weight_dtype'], row.get('draft_threshold', 0)) == \
         (1, 'float32', 0):
        ratios.setdefault(f"T{row['temperature']:g}", {})[str(row['num_drafts'])] = \
            row['iteration_cost_ratio']
    if ratios:
      machine = run.get('machine', bench.get('machine', {}))
      return {'cost_ratio': ratios, 'command': run['command'], 'commit': run.get('commit'),
              'date': run.get('date'), 'machine': machine.get('description', machine.get('cpu')),
              'model': res['model']}
  return None
