"""Drafters on a fixed verifier: `configs/drafter.py:<arm>[,smoke]`.

Per seed one next-token trunk (`trunk`: the sized sweep's d0, configs/ablation.py's
`d0,decay` shape and schedule, TRUNK_STEPS steps) is trained once; every other arm then
trains only its MTP modules on that trunk, frozen (model.mtp.freeze_trunk, started from
the trunk's final state as --init_from starts a run), for ARM_STEPS steps of the same
1,024 tokens each and the same schedule shape (warmup, cosine decay to 0.1x). The arms:

- `ref`: the reference drafter, three chained sequential modules (DeepSeek-V3), trained on
  the corpus's tokens, constant lambda 0.3, no curriculum;
- `shared`: one sequential module whose weights serve all three depths
  (model.mtp.share_modules; FastMTP's recursive drafter);
- `self`: ref trained on the trunk's own greedy tokens (loss.mtp_targets 'self');
- `lamdecay`: ref with lambda decayed linearly 0.3 -> 0.1 over the run (DeepSeek-V3's values;
  it switched once, after 10 T of its 14.8 T tokens);
- `fwd`, `rev`: ref under the forward / reverse depth curriculum (model.mtp.curriculum);
- `leap`: leap targets o = (2, 4, 6) whose depths read no token their leap skips
  (model.mtp.strict_leaps); only depth 1 (o = 2) can draft.

Seed s sets the trunk's initialisation and data order and, for every arm, the MTP
modules' initialisation and data order: one seed is one trunk and its seven drafters.
The endpoints and their test families: DRAFTER_* in mtp_jax/research/design.py.
`,smoke`: configs/ablation.py's `,smoke` shapes and a few steps (tests).

  mtp-ablation --groups drafter --seeds 0,1,2,3,4,5,6,7,8,9
"""
import os

from mtp_jax import config_files

ABLATION = config_files.load_module(os.path.join(os.path.dirname(__file__), 'ablation.py'))

TRUNK = 'trunk'
BASELINE = 'ref'
DEPTH = 3
# arm -> the model.mtp / loss fields it sets on top of ref's (ARM_STEPS is filled in below)
ARMS = {
    'ref': {},
    'shared': {'model.mtp.share_modules': True},
    'self': {'loss.mtp_targets': 'self'},
    'lamdecay': {'model.mtp.lambda_schedule': 'linear', 'model.mtp.lambda_values': (0.3, 0.1),
                 'model.mtp.lambda_boundaries': (0, 'steps')},
    'fwd': {'model.mtp.curriculum': 'forward'},
    'rev': {'model.mtp.curriculum': 'reverse'},
    'leap': {'model.mtp.target_offsets': (2, 4, 6), 'model.mtp.strict_leaps': True},
}
VARIANTS = {TRUNK: None, **ARMS}  # every run of a seed, the trunk first
# The production recipe, declared (mtp_jax/research/design.py's PRODUCTION_ARMS) and run only
# when --variants names it: one shared module on the frozen trunk's whole distribution.
PRODUCTION_ARMS = {'shared_soft': {'model.mtp.share_modules': True, 'loss.mtp_targets': 'soft'}}
TRUNK_STEPS = 1010  # the sized sweep's equal-token steps: the trunk is its d0
ARM_STEPS = 1010  # every arm: the same steps and tokens
SMOKE_TRUNK_STEPS, SMOKE_ARM_STEPS = 8, 6

DEVICES = 1  # mesh.axes: one device per run, as configs/ablation.py


def _set(c, dotted: str, value):
  *path, last = dotted.split('.')
  node = c
  for p in path:
    node = node[p]
  node[last] = value


def get_config(arg: str = 'ref'):
  arm, *opts = arg.split(',')
  if (arm not in VARIANTS and arm not in PRODUCTION_ARMS) or any(o != 'smoke' for o in opts):
    raise ValueError(f'configs/drafter.py: unknown argument {arg!r}; use '
                     f'configs/drafter.py:<arm>[,smoke] with arm one of '
                     f'{", ".join([*VARIANTS, *PRODUCTION_ARMS])}')
  smoke = 'smoke' in opts
  c = ABLATION.get_config('d0,decay' + (',smoke' if smoke else ''))
  if arm == TRUNK:
    c.train.steps = SMOKE_TRUNK_STEPS if smoke else TRUNK_STEPS
    return c
  steps = SMOKE_ARM_STEPS if smoke else ARM_STEPS
  c.train.steps = steps
  c.model.mtp.depth, c.model.mtp.kind = DEPTH, 'sequential'
  c.model.mtp.freeze_trunk = True
  for dotted, value in {**ARMS, **PRODUCTION_ARMS}[arm].items():
    if dotted == 'model.mtp.lambda_boundaries':
      value = tuple(steps if v == 'steps' else v for v in value)
    _set(c, dotted, value)
  return c
