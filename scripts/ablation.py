"""Head-kind ablation at equal compute: trains configs/ablation.py's variants and tabulates them.

  python scripts/ablation.py --workdir runs/ablation --run          # train, then the table
  python scripts/ablation.py --workdir runs/ablation --json         # table of what is there

--run trains each variant in ROOT/<variant> with scripts/train.py (one subprocess each,
one after the other; a finished variant is not retrained, an interrupted one resumes).
The table, per variant: training FLOPs and steps, the last evaluation's validation loss
and bits per byte of the main head, loss and teacher-forced agreement with the main head
per MTP depth (metrics.jsonl), and greedy
self-speculative decoding of held-out validation prompts (the prompts of
benchmarks/decode_speed.py and scripts/eval.py, decoded by the same
evaluation.decode_metrics): tau (tokens per verify step), the acceptance per depth and
whether the output equals plain autoregressive decoding.
"""
import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mtp_jax.metrics import TAU_KEY, metric_key  # noqa: E402  (numpy only; JAX starts later)

VARIANTS = ('none', 'sequential', 'parallel')


def parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--workdir', required=True, help='root: one run directory per variant')
  p.add_argument('--run', action='store_true', help='train the variants that are not finished')
  p.add_argument('--json', action='store_true', help='print JSON instead of a Markdown table')
  p.add_argument('--variants', default=','.join(VARIANTS))
  p.add_argument('--smoke', action='store_true',
                 help='the tiny-model ablation (configs/ablation.py:<variant>,smoke): seconds')
  p.add_argument('--train_flag', action='append', default=[],
                 help='extra flag for scripts/train.py, e.g. --train_flag=--config.data.data_dir=D')
  p.add_argument('--num_prompts', type=int, default=8, help='validation prompts decoded')
  p.add_argument('--prompt_len', type=int, default=0, help='prompt tokens (0: 128, smoke 16)')
  p.add_argument('--max_new_tokens', type=int, default=0, help='(0: 128, smoke 16)')
  args = p.parse_args(argv)
  args.variants = args.variants.split(',')
  bad = [v for v in args.variants if v not in VARIANTS]
  if bad:
    p.error(f'unknown variant(s) {bad}; choose from {", ".join(VARIANTS)}')
  args.prompt_len = args.prompt_len or (16 if args.smoke else 128)
  args.max_new_tokens = args.max_new_tokens or (16 if args.smoke else 128)
  return args


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def final_eval(workdir: str) -> dict | None:
  """The evaluation at the run's last step (config.json's train.steps), or None."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    steps = json.load(f)['train']['steps']
  key = metric_key('eval', 'loss', 0)
  evals = [m for m in read_metrics(workdir) if m.get('step') == steps and key in m]
  return evals[-1] if evals else None


def train(args, variant: str) -> None:
  workdir = os.path.join(args.workdir, variant)
  if final_eval(workdir):
    print(f'{variant}: finished, not retrained ({workdir})', file=sys.stderr)
    return
  config = f'configs/ablation.py:{variant}' + (',smoke' if args.smoke else '')
  cmd = [sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
         '--config', os.path.join(REPO, config), '--workdir', workdir, *args.train_flag]
  print(f'{variant}: {" ".join(cmd)}', file=sys.stderr, flush=True)
  proc = subprocess.run(cmd, cwd=REPO, check=False)
  if proc.returncode:
    sys.exit(f'error: training {variant} failed (exit {proc.returncode}); rerun to resume')


def tabulate_variant(args, variant: str) -> dict:
  """Training FLOPs, validation figures and decode statistics of one finished variant."""
  from mtp_jax import checkpoint, decode, evaluation, flops, state
  from mtp_jax.data import tokenizers
  workdir = os.path.join(args.workdir, variant)
  ev = final_eval(workdir)
  if ev is None:
    return {'variant': variant, 'finished': False}
  config, step = checkpoint.load_workdir(workdir)
  depth, kind = int(config.model.mtp.depth), config.model.mtp.kind
  tokens = config.data.batch_size * config.data.seq_len
  per_step = flops.config_flops_per_token(config).train * tokens
  train_rows = [m for m in read_metrics(workdir) if 'perf/step_time' in m]
  row = {
      'variant': variant, 'finished': True, 'depth': depth, 'kind': kind if depth else None,
      'steps': int(config.train.steps), 'tokens_per_step': tokens,
      'train_flops': per_step * config.train.steps, 'flops_per_step': per_step,
      # Wall time of the training steps (compilation, evaluation and saves excluded):
      # each log line's step_time covers the steps since the previous line.
      'train_seconds': _train_seconds(train_rows),
      'val_loss_main': ev[metric_key('eval', 'loss', 0)],
      'val_bpb_main': ev[metric_key('eval', 'bpb', 0)],
      'val_loss_per_depth': [ev[metric_key('eval', 'loss', k)] for k in range(1, depth + 1)],
      'val_acc_per_depth': [ev.get(metric_key('eval', 'acc', k)) for k in range(1, depth + 1)],
      'val_agree_per_depth': [ev.get(metric_key('eval', 'agree', k))
                              for k in range(1, depth + 1)],
  }
  tokenizer = tokenizers.get_tokenizer(config.data)
  prompts = evaluation.validation_prompts(config, tokenizer, args.num_prompts, args.prompt_len)
  dec = decode.Decoder(state.restore_model(config, workdir, step))
  # The trainer's and scripts/eval.py's decode figures: greedy, no EOS, spec vs AR.
  dm = evaluation.decode_metrics(dec, prompts, args.max_new_tokens, compare=True)
  row['ar_tokens_per_sec'] = dm['eval/decode_ar_tokens_per_sec']
  if depth:
    row.update(tau=dm[TAU_KEY],
               acceptance_per_depth=[dm[metric_key('eval', 'decode_accept', k)]
                                     for k in range(1, depth + 1)],
               identical_to_ar=dm['eval/decode_identical'],
               spec_tokens_per_sec=dm['eval/decode_spec_tokens_per_sec'],
               speedup=dm['eval/decode_speedup'])
  else:  # no drafts: every main-model pass commits exactly one token
    row.update(tau=1.0, acceptance_per_depth=[], identical_to_ar=None)
  row['decode'] = {'prompts': len(prompts), 'prompt_len': args.prompt_len,
                   'max_new_tokens': args.max_new_tokens, 'greedy': True}
  return row


def _train_seconds(rows: list[dict]) -> float:
  total, prev = 0.0, 0
  for m in sorted(rows, key=lambda m: m['step']):
    if m['step'] > prev:
      total += m['perf/step_time'] * (m['step'] - prev)
      prev = m['step']
  return total


def markdown(rows: list[dict]) -> str:
  def seq(xs, fmt='{:.3f}'):
    return ' / '.join(fmt.format(x) for x in xs) if xs else 'n.a.'

  out = ['| variant | D | steps | train TFLOP | train wall (min) | val loss main (nats) | '
         'val bpb main | val loss per depth | val agreement per depth | tau | '
         'acceptance per depth | spec == AR |',
         '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    if not r['finished']:
      out.append(f'| {r["variant"]} | not finished |' + ' |' * 10)
      continue
    ident = 'n.a.' if r['identical_to_ar'] is None else ('yes' if r['identical_to_ar'] else 'NO')
    tau = '1 (n.a.)' if not r['depth'] else f'{r["tau"]:.2f}'
    out.append(
        f'| {r["variant"]} | {r["depth"]} | {r["steps"]} | {r["train_flops"] / 1e12:.2f} | '
        f'{r["train_seconds"] / 60:.1f} | {r["val_loss_main"]:.4f} | {r["val_bpb_main"]:.4f} | '
        f'{seq(r["val_loss_per_depth"])} | {seq(r["val_agree_per_depth"], "{:.2f}")} | {tau} | '
        f'{seq(r["acceptance_per_depth"], "{:.2f}")} | {ident} |')
  return '\n'.join(out)


def main(argv=None):
  args = parse(argv)
  os.makedirs(args.workdir, exist_ok=True)
  if args.run:
    for v in args.variants:
      train(args, v)
  rows = [tabulate_variant(args, v) for v in args.variants]
  if args.json:
    print(json.dumps({'workdir': os.path.abspath(args.workdir), 'variants': rows}, indent=1))
  else:
    print(markdown(rows))


if __name__ == '__main__':
  main()
