"""Which training signal makes the best drafts for a frozen trunk? (the FastMTP recipe)

  python benchmarks/compare_mtp_targets.py [--root runs/compare_mtp_targets]
      [--out benchmarks/results/compare_mtp_targets.json] [--num_prompts 32] [--sample_seeds 2]

One command, four stages (a stage whose workdir already holds its last checkpoint is
skipped, so an interrupted run picks up where it stopped):
  1. trunk: a small M = 0 byte-level model on the stdlib corpus (README's recipe model);
  2. self-distilled data: scripts/self_distill.py samples the trunk's own continuations
     (T = 1) of prompts drawn from the corpus's train split;
  3. M = 3 MTP modules on the frozen trunk (model.mtp.freeze_trunk), one run per signal:
       data_text    corpus text, loss.mtp_targets=data (the true next tokens)
       self_targets corpus text, loss.mtp_targets=self (the trunk's greedy tokens)
       distilled    self-distilled text, loss.mtp_targets=data (the trunk's sampled tokens)
       soft_targets corpus text, loss.mtp_targets=soft (the trunk's whole distribution)
       distilled_soft self-distilled text, loss.mtp_targets=soft
  4. every run evaluated on the same held-out corpus data (the stdlib validation split,
     whatever it trained on): teacher-forced agreement of depth k with the trunk, and
     free-running tau / acceptance per depth of self-speculative decoding with 3 drafts,
     greedy (checked identical to AR) and T = 1 sampling.
Writes one JSON (settings, commands, per-run figures, uptime before / after). --smoke
trains 2 steps per stage, distils 8 prompts and runs only `distilled` (a test: its
figures mean nothing).
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import common  # benchmarks/common.py

HERE = os.path.dirname(os.path.abspath(__file__))

REPO = common.REPO
NAME = 'compare_mtp_targets'

# The trunk of README's "give an existing model MTP drafting" recipe.
MODEL = ['--config', os.path.join(REPO, 'configs', 'tiny.py'), '--config.model.d_model=128',
         '--config.model.n_layers=3', '--config.model.n_heads=2', '--config.model.n_kv_heads=2',
         '--config.model.head_dim=64', '--config.model.mlp_dim=384', '--config.data.seq_len=128',
         '--config.data.batch_size=16', '--config.train.eval_batches=4',
         '--config.train.progress=False']
TRUNK_STEPS, MTP_STEPS, DEPTH = 400, 200, 3
DISTILL = dict(num_prompts=4096, prompt_len=32, max_new_tokens=96, temperature=1.0, seed=0,
               batch_size=128)
RUNS = {  # name: (mtp_targets, trained on the self-distilled data)
    'data_text': ('data', False),
    'self_targets': ('self', False),
    'distilled': ('data', True),
    'soft_targets': ('soft', False),
    'distilled_soft': ('soft', True),
}


def parse(argv):
  p = common.parser(NAME, __doc__)
  p.add_argument('--root', default=os.path.join(REPO, 'runs', NAME), help='workdirs and logs')
  p.add_argument('--num_prompts', type=int, default=32, help='held-out prompts decoded')
  p.add_argument('--prompt_len', type=int, default=64)
  p.add_argument('--max_new_tokens', type=int, default=64)
  p.add_argument('--sample_seeds', type=int, default=2, help='T = 1 decodes (seeds 0..n-1)')
  p.add_argument('--eval_batches', type=int, default=8, help='teacher-forced batches')
  p.add_argument('--data_dir', default='', help='data.data_dir of the stdlib data set')
  args = p.parse_args(argv)
  if args.smoke:
    ENV_DROP.append('XLA_FLAGS')
    args.num_prompts, args.prompt_len, args.max_new_tokens = 2, 16, 8
    args.sample_seeds, args.eval_batches = 1, 1
  return args


SMOKE = {'trunk_steps': 2, 'mtp_steps': 2, 'runs': ('distilled',),
         'distill': dict(DISTILL, num_prompts=16, batch_size=16, max_new_tokens=16),
         # small batches of short rows, and a validation split the 16 records can fill
         'extra': ['--config.data.batch_size=2', '--config.data.seq_len=64',
                   '--config.train.eval_batches=1', '--config.train.eval_decode_tokens=8'],
         'distilled_extra': ['--config.data.validation_percent=25']}


def _uptime() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


def _finished(workdir: str, step: int) -> bool:
  return os.path.isdir(os.path.join(workdir, 'checkpoints', str(step)))


# --smoke: the trainer's own device choice, whatever device count the caller forced
ENV_DROP = []


def _env() -> dict:
  env = dict(os.environ, PYTHONPATH=REPO)
  for k in ENV_DROP:
    env.pop(k, None)
  return env


def _stage(name, cmd, root, done, log_runs):
  """Runs cmd (logged to root/name.log) unless done; records command, wall time, uptime.

  Records persist in root/stages.json, so a rerun that skips a finished stage keeps them.
  """
  path = os.path.join(root, 'stages.json')
  saved = json.loads(pathlib.Path(path).read_text()) if os.path.exists(path) else {}
  entry = {'command': ' '.join(cmd[1:]).replace(REPO + '/', '')}
  if done():
    entry = saved.get(name, dict(entry, skipped='finished before stages were recorded'))
  else:
    start, entry['uptime_before'] = time.time(), _uptime()
    with open(os.path.join(root, f'{name}.log'), 'w') as log:
      proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=_env())
    if proc.returncode:
      sys.exit(f'stage {name} failed (exit {proc.returncode}); see {root}/{name}.log')
    entry.update(wall_s=round(time.time() - start, 1), uptime_after=_uptime())
  log_runs[name] = saved[name] = entry
  with open(path, 'w') as f:
    json.dump(saved, f, indent=1)


def plan_of(args) -> dict:
  """Steps, distillation settings and runs: the real ones, or --smoke's."""
  plan = SMOKE if args.smoke else {'trunk_steps': TRUNK_STEPS, 'mtp_steps': MTP_STEPS,
                                   'distill': DISTILL, 'runs': tuple(RUNS)}
  data = [f'--config.data.data_dir={args.data_dir}'] if args.data_dir else []
  return dict(plan, model=MODEL + data + plan.get('extra', []))


def train_all(root: str, stages: dict, plan: dict) -> str:
  py = sys.executable
  trunk, distilled = os.path.join(root, 'trunk'), os.path.join(root, 'distilled_data')
  ts, ms = plan['trunk_steps'], plan['mtp_steps']
  _stage('trunk', [py, 'scripts/train.py', *plan['model'], f'--workdir={trunk}',
                   '--config.model.mtp.depth=0', f'--config.train.steps={ts}',
                   f'--config.train.warmup_steps={min(40, ts)}',
                   f'--config.train.eval_every={min(200, ts)}',
                   f'--config.train.checkpoint_every={min(200, ts)}'],
         root, lambda: _finished(trunk, ts), stages)
  _stage('self_distill', [py, 'scripts/self_distill.py', f'--workdir={trunk}',
                          f'--out={distilled}']
         + [f'--{k}={v}' for k, v in plan['distill'].items()],
         root, lambda: os.path.exists(os.path.join(distilled, 'meta.json')), stages)
  for name in plan['runs']:
    targets, on_distilled = RUNS[name]
    workdir = os.path.join(root, name)
    data = (['--config.data.source=jsonl', f'--config.data.path={distilled}/data.jsonl',
             '--config.data.tokens_key=tokens', *plan.get('distilled_extra', [])]
            if on_distilled else [])
    _stage(name, [py, 'scripts/train.py', *plan['model'], f'--workdir={workdir}',
                  f'--init_from={trunk}',
                  f'--config.model.mtp.depth={DEPTH}', '--config.model.mtp.freeze_trunk=True',
                  f'--config.loss.mtp_targets={targets}', f'--config.train.steps={ms}',
                  f'--config.train.warmup_steps={min(20, ms)}', '--config.train.eval_every=0',
                  f'--config.train.checkpoint_every={ms}', *data],
           root, lambda w=workdir: _finished(w, ms), stages)
  return trunk


def _last_train_metrics(workdir: str) -> dict:
  last = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      rec = json.loads(line)
      if any(k.startswith('train/') for k in rec):
        last = rec
  return {k: v for k, v in last.items() if k.startswith('train/loss')}


def evaluate_all(root: str, trunk: str, args, runs) -> dict:
  """Every run on the trunk's held-out corpus data: one process, programs compiled once."""
  import jax  # pylint: disable=g-import-not-at-top  (JAX starts after the training stages)
  import numpy as np  # pylint: disable=g-import-not-at-top

  from mtp_jax import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
  from mtp_jax import config_lib  # pylint: disable=g-import-not-at-top
  from mtp_jax.data import pipeline, tokenizers  # pylint: disable=g-import-not-at-top
  from mtp_jax.train import (
    evaluation,  # pylint: disable=g-import-not-at-top
    steps,
  )
  from mtp_jax.train.metrics import metric_key  # pylint: disable=g-import-not-at-top

  corpus, _ = ckpt_lib.load_workdir(trunk)
  devices = jax.local_devices()[:1]
  results = {}
  for name in runs:
    workdir = os.path.join(root, name)
    config, step = ckpt_lib.load_workdir(workdir)
    for k in config.data.keys():  # the corpus's validation split, whatever it trained on
      config.data[k] = corpus.data[k]
    config.mesh.shape = None  # one device, whatever mesh it trained on
    for axis, size in config_lib.DEFAULT_AXES.items():
      config.mesh.axes[axis] = size
    tok = tokenizers.get_tokenizer(config.data)
    ts, _ = steps.setup(config, devices)
    state = ckpt_lib.restore_state(workdir, step, ts.abstract_state).state
    batches = pipeline.make_eval_batches(config, num_batches=args.eval_batches)
    ev = evaluation.evaluate(ts, state, batches, evaluation.padded_token_bytes(config, tok))
    decoder = evaluation.local_decoder(ts.graphdef, state, ts.mesh)
    prompts = evaluation.validation_prompts(config, tok, args.num_prompts, args.prompt_len)
    kw = dict(batch_size=len(prompts), eos_id=None, pad_to=(args.prompt_len, args.max_new_tokens))
    ar = decoder.generate_batched(prompts, args.max_new_tokens, num_drafts=0, **kw)
    greedy = decoder.generate_batched(prompts, args.max_new_tokens, num_drafts=DEPTH, **kw)
    sampled = [decoder.generate_batched(prompts, args.max_new_tokens, num_drafts=DEPTH,
                                        temperature=1.0, seed=s, **kw).stats()
               for s in range(args.sample_seeds)]
    g = greedy.stats()
    steps_t1 = sum(s['verify_steps'] for s in sampled)
    results[name] = {
        'step': step, 'mtp_targets': RUNS[name][0],
        'trained_on': 'self-distilled' if RUNS[name][1] else 'corpus',
        'eval_loss_main': ev[metric_key('eval', 'loss', 0)],
        'agree': [ev[metric_key('eval', 'agree', k)] for k in range(1, DEPTH + 1)],
        'acc_vs_data': [ev[metric_key('eval', 'acc', k)] for k in range(1, DEPTH + 1)],
        'loss_vs_data': [ev[metric_key('eval', 'loss', k)] for k in range(1, DEPTH + 1)],
        'eval_tokens': ev[metric_key('eval', 'tokens')],
        'greedy_tau': g['mean_accepted_length'],
        'greedy_accept': g['acceptance_per_depth'],
        'greedy_identical_to_ar': all(np.array_equal(a, b)
                                      for a, b in zip(ar.tokens, greedy.tokens)),
        'sampled_tau': sum(s['committed'] for s in sampled) / max(steps_t1, 1),
        'sampled_tau_per_seed': [s['mean_accepted_length'] for s in sampled],
        'sampled_accept': [sum(s['acceptance_per_depth'][k] * s['verify_steps'] for s in sampled)
                           / max(steps_t1, 1) for k in range(DEPTH)],
        'final_train_losses': _last_train_metrics(workdir),
    }
    print(f"{name}: agree {[f'{a:.3f}' for a in results[name]['agree']]}  greedy tau "
          f"{g['mean_accepted_length']:.3f}  T=1 tau {results[name]['sampled_tau']:.3f}",
          file=sys.stderr)
  return results


def main(argv=None) -> int:
  args = parse(argv)
  run = common.start(args, NAME, argv, 'benchmarks/compare_mtp_targets.py')
  plan = plan_of(args)
  os.makedirs(args.root, exist_ok=True)
  start, up = time.time(), _uptime()
  stages = {}
  trunk = train_all(args.root, stages, plan)
  eval_start = time.time()
  results = evaluate_all(args.root, trunk, args, plan['runs'])
  rel = lambda x: json.loads(json.dumps(x).replace(REPO + '/', ''))  # noqa: E731
  out = {
      'uptime_before': up, 'uptime_after': _uptime(),
      'wall_s_total': round(time.time() - start, 1),
      'wall_s_eval': round(time.time() - eval_start, 1),
      'trunk': {'model_flags': ' '.join(plan['model']).replace(REPO + '/', ''),
                'steps': plan['trunk_steps']},
      'mtp': {'depth': DEPTH, 'steps': plan['mtp_steps'], 'freeze_trunk': True},
      'self_distill': plan['distill'],
      'eval': {'split': 'python_stdlib validation (held out from every run)',
               'teacher_forced_batches': args.eval_batches, 'num_prompts': args.num_prompts,
               'prompt_len': args.prompt_len, 'max_new_tokens': args.max_new_tokens,
               'sample_seeds': args.sample_seeds, 'drafts': DEPTH},
      'stages': rel(stages), 'runs': rel(results),
  }
  common.write(run, out)
  print(json.dumps({k: (v['agree'], v['greedy_tau'], v['sampled_tau'])
                    for k, v in results.items()}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
