"""Multi-seed research sweeps: resumable in-process runs, evaluations, statistics.

scripts/ablation.py drives it. One process trains every run of a sweep one after the
other; runs of one variant share a compiled train step (only the seed differs), and
each run checkpoints its state, data iterator and results so far every `save_every`
steps, so a killed sweep resumes the interrupted run where its last checkpoint left
it and skips every run whose JSON is already written.

Two kinds of run:
- `lm`: byte-level language modelling on the stdlib corpus (data.shuffle_seed and the
  init seed are the run's seed). It is evaluated at named steps (`eval_at`: e.g. the
  equal-FLOP and the equal-token budget of one schedule) on the stdlib validation
  split and on the held-out corpus (`heldout_documents`), teacher-forced per depth
  with per-batch figures for standard errors, and by free-running decoding of
  held-out prompts, greedy and sampled.
- `induction`: mtp_jax.data.induction batches; accuracy on the copyable second
  occurrence every `eval_every` steps.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax.research.results as results_lib
from mtp_jax.checkpoint import integrity
from mtp_jax.checkpoint import partial as partial_restore
from mtp_jax.checkpoint.store import Checkpointer
from mtp_jax.config.base import base_config
from mtp_jax.config.readers import optional
from mtp_jax.data import induction, pipeline, tokenizers
from mtp_jax.errors import RequestError
from mtp_jax.research.heldout import HeldoutRule, heldout_documents, pack_rows, prompts_from
from mtp_jax.research.stats import batch_bpb_se
from mtp_jax.runtime import machine, sharding
from mtp_jax.train import evaluation
from mtp_jax.train import flops as flops_lib
from mtp_jax.train import steps as steps_lib
from mtp_jax.train_state.state import init_state

RESULT_VERSION = 1


# -- one run ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
  """One training run of a sweep: a variant's config at one seed."""
  group: str  # the output file OUT/<group>.json, e.g. 'lm' or 'induction'
  variant: str
  seed: int
  config: object  # ml_collections ConfigDict; its seed / shuffle_seed are set by the sweep
  kind: str = 'lm'  # 'lm' | 'induction'
  eval_at: dict = dataclasses.field(default_factory=dict)  # name -> step ('lm')
  eval_every: int = 0  # 'induction': accuracy every this many steps (and at 0)
  task: dict = dataclasses.field(default_factory=dict)  # 'induction': InductionTask fields
  log_every: int = 10
  save_every: int = 50
  # Starts from another run's final state (a checkpoints directory that `keep_final` of
  # that run wrote), as --init_from starts a run: model.mtp.freeze_trunk drafters.
  init_from: str = ''
  # Keeps the run's final state in this checkpoints directory (its config in the meta,
  # fingerprinted), for runs that start from it; `final_needed`: a finished run whose
  # final state is gone is trained again from its seed.
  keep_final: str = ''
  final_needed: bool = False

  @property
  def name(self) -> str:
    return f'{self.variant}_s{self.seed}'

  @property
  def steps(self) -> int:
    return int(self.config.train.steps)


def flops_per_step(config) -> float:
  """Training FLOPs of one step (a frozen trunk runs forward only: train_frozen_trunk)."""
  tokens = config.data.batch_size * config.data.seq_len
  per = flops_lib.config_flops_per_token(config)
  if optional(config, 'model.mtp.freeze_trunk', False):
    return float(per.train_frozen_trunk(config.model.mtp.depth) * tokens)
  return float(per.train * tokens)


def batches_fingerprint(batches: Sequence[dict]) -> str:
  """A digest of evaluation batches (every array, in order): two runs that scored the same
  tokens have the same one, whichever interpreter's standard library they were cut from."""
  digest = hashlib.sha256()
  for batch in batches:
    for key in sorted(batch):
      a = np.ascontiguousarray(batch[key])
      digest.update(f'{key}:{a.dtype.str}:{a.shape}\n'.encode())
      digest.update(a.tobytes())
  return digest.hexdigest()[:12]


class LMEvaluator:
  """The fixed evaluation sets of an lm sweep: stdlib validation, held-out, prompts."""

  def __init__(self, config, *, eval_batches: int, num_prompts: int, prompt_len: int,
               new_tokens: int, temperatures: Sequence[float] = (0.0, 1.0, 0.7),
               heldout_rule: HeldoutRule = HeldoutRule(), decode_seed: int = 0):
    tok = tokenizers.get_tokenizer(config.data)
    self.token_bytes = evaluation.padded_token_bytes(config, tok)
    self.batch_size, self.eval_batches = config.data.batch_size, eval_batches
    self.sets = {'stdlib_val': pipeline.make_eval_batches(config, num_batches=eval_batches)}
    docs, self.heldout_desc = heldout_documents(heldout_rule)
    texts = [t for _, t in docs]
    rows = pack_rows(texts, tok, config.data.seq_len, eval_batches * self.batch_size)
    b = self.batch_size
    self.sets['heldout'] = [{k: v[i * b:(i + 1) * b] for k, v in rows.items()}
                            for i in range(eval_batches)]
    self.prompts = prompts_from(texts, tok, num_prompts, prompt_len) if num_prompts else []
    self.new_tokens, self.temperatures, self.decode_seed = new_tokens, temperatures, decode_seed
    self.describe = {'eval_batches': eval_batches, 'tokens_per_set': eval_batches * b *
                     config.data.seq_len, 'heldout': self.heldout_desc,
                     'stdlib_val': {'fingerprint': batches_fingerprint(self.sets['stdlib_val'])},
                     'decode': {'prompts': len(self.prompts), 'prompt_len': prompt_len,
                                'new_tokens': new_tokens, 'temperatures': list(temperatures),
                                'eos': None, 'seed': decode_seed}}

  def teacher_forced(self, ts, state) -> dict:
    out = {}
    with sharding.use_mesh(ts.mesh, ts.rules):
      tb = jax.device_put(jnp.asarray(self.token_bytes, jnp.int32), sharding.replicated(ts.mesh))
      for name, batches in self.sets.items():
        per = [jax.device_get(ts.eval_step(state, sharding.host_batch_to_global(bt, ts.mesh), tb))
               for bt in batches]
        tot = {k: np.sum([p[k] for p in per], axis=0) for k in per[0]}
        count = np.maximum(tot['count'], 1)
        depths = len(count)
        bpb = tot['loss_sum'] / (math.log(2) * np.maximum(tot['bytes'], 1))
        out[name] = {
            'bpb': bpb.tolist(), 'loss': (tot['loss_sum'] / count).tolist(),
            'acc': (tot['correct'] / count).tolist(),
            'agree': (tot['agree'] / count).tolist()[1:],
            'bpb_se_main': batch_bpb_se([p['loss_sum'][0] for p in per],
                                        [p['bytes'][0] for p in per]),
            'batch_loss_sum_main': [float(p['loss_sum'][0]) for p in per],
            'batch_bytes_main': [float(p['bytes'][0]) for p in per],
            'tokens': float(tot['count'][0]), 'depths': depths}
    return out

  def decode(self, ts, state) -> dict:
    """Free-running decoding with every depth that can draft (ModelArgs.drafting_depths),
    whatever a curriculum left active at the end of training."""
    if not self.prompts:
      return {}
    dec = evaluation.local_decoder(ts.graphdef, state, ts.mesh)
    drafting = dec.args.drafting_depths()
    if not drafting:
      return {}
    out = {}
    for temp in self.temperatures:
      res = dec.generate(self.prompts, self.new_tokens, num_drafts=drafting, temperature=temp,
                         eos_id=None, seed=self.decode_seed)
      st = res.stats()
      out[f'T{temp:g}'] = {'tau': st['mean_accepted_length'],
                           'acceptance_per_depth': st['acceptance_per_depth'],
                           'conditional_acceptance': st['conditional_acceptance'],
                           'verify_steps': st['verify_steps'], 'new_tokens': st['new_tokens'],
                           'distinct_4grams': distinct_ngrams(res.tokens, 4)}
    return out


def host_record() -> dict:
  """Where a run's train_seconds were taken: CPU model, its vector extensions, usable
  cores, the Python and JAX versions and the load average as the run ended."""
  return {'cpu': machine.cpu_model(), 'vector_flags': machine.cpu_flags(),
          'cores': machine.usable_cores(), 'python': platform.python_version(),
          'jax': jax.__version__, 'load_average': [round(x, 2) for x in os.getloadavg()]}


def distinct_ngrams(rows: Sequence[np.ndarray], n: int) -> float:
  """Distinct n-grams / n-grams over the generated rows: near 0 when the text loops."""
  total, distinct = 0, 0
  for r in rows:
    grams = [tuple(r[i:i + n]) for i in range(len(r) - n + 1)]
    total += len(grams)
    distinct += len(set(grams))
  return distinct / max(total, 1)


class InductionEvaluator:
  """Copy accuracy of the main head on a fixed evaluation set of an induction task."""

  def __init__(self, task, rows: int):
    self.task, self.batch = task, task.eval_batch(rows)
    self._fns = {}  # id(TrainSetup) -> the jitted main-head argmax of its model

  def __call__(self, ts, state) -> dict:
    if id(ts) not in self._fns:
      graphdef = ts.graphdef

      def predict(state, tokens, positions, seg):
        model, _ = nnx.merge(graphdef, state)
        hiddens = model(tokens, positions, seg)
        return jnp.argmax(model.logits(hiddens[0], 0), axis=-1)
      self._fns[id(ts)] = jax.jit(predict)
    b = self.batch
    with sharding.use_mesh(ts.mesh, ts.rules):
      pred = np.asarray(self._fns[id(ts)](state, b['tokens'], b['positions'],
                                          b['segment_ids']))
    # Also the accuracy on every other (in-document) target: for the random spans about
    # chance, a sanity check; for the stories the text around the names.
    rand = ~b['copy_mask'][:, 1:] & (b['segment_ids'][:, 1:] == b['segment_ids'][:, :-1]) \
        & (b['segment_ids'][:, :-1] != 0)
    return {'copy_acc': induction.copy_accuracy(pred, b),
            'other_acc': float(((pred[:, :-1] == b['tokens'][:, 1:]) & rand).sum() / rand.sum())}


class Interrupted(RuntimeError):
  """Sweep.stop_at reached (tests of resumption)."""


class Sweep:
  """Runs a list of Runs; results to `out_dir/<group>.json`, checkpoints to workdir."""

  def __init__(self, workdir: str, out_dir: str, *, log: Callable[[str], None] = print,
               devices=None):
    self.workdir, self.out_dir, self.log = workdir, out_dir, log
    self.devices = (jax.devices() if devices is None else devices)[:1]
    self._setups = {}  # variant key -> TrainSetup (one compiled step for every seed)
    self.stop_at: int | None = None  # tests: raise Interrupted after saving this step
    self.lm_eval: LMEvaluator | None = None
    self.induction_eval: InductionEvaluator | None = None
    self.induction_evals: dict[str, InductionEvaluator] = {}  # per group, else induction_eval

  def result_path(self, run: Run) -> str:
    return results_lib.results_path(self.out_dir, run.group)

  def saved(self, run: Run) -> dict | None:
    """The run's finished result in the output folder, or None."""
    saved = results_lib.find_result(self.out_dir, run.group, run.variant, run.seed)
    if saved is not None and not same_config(saved.get('config'),
                                             _config_dict(_resolved(run.config))):
      raise RequestError(f'{self.result_path(run)} holds {run.name} of another config; '
                       'move the file away to rerun')
    return saved

  def finished(self, run: Run) -> bool:
    return self.saved(run) is not None

  def to_run(self, run: Run) -> bool:
    """Whether run() trains it: unfinished, or finished without the final state it keeps
    for runs still to start from it."""
    return not self.finished(run) or (run.final_needed and not has_final(run))

  def _setup(self, run: Run):
    key = (run.group, run.variant)
    if key not in self._setups:
      cfg = _resolved(run.config)
      cfg.seed = 0
      self._setups[key] = steps_lib.setup(cfg, self.devices)[0]
    return self._setups[key]

  def run(self, run: Run) -> dict:
    saved = self.saved(run)
    if saved is not None and not self.to_run(run):
      self.log(f'{run.group}/{run.name}: finished, not rerun ({self.result_path(run)})')
      return saved
    config = _resolved(run.config)
    ts = self._setup(run)
    _, state, _, _ = init_state(config, ts.mesh, ts.rules)
    data_iter, next_batch = None, None
    if run.kind == 'lm':
      data_iter = pipeline.make_train_iter(config)
      next_batch = lambda step: next(data_iter)  # noqa: E731
    else:
      task = induction.make_task(config.data.seq_len, **run.task)
      b = config.data.batch_size
      next_batch = lambda step: {k: v for k, v in task.batch(run.seed, step, b).items()  # noqa: E731
                                 if k != 'copy_mask'}
    ckpt_dir = os.path.join(self.workdir, run.group, run.name)
    ckpt = Checkpointer(ckpt_dir, max_to_keep=1, async_save=False)
    result = {'curve': [], 'evals': {}, 'train_seconds': 0.0}
    start, window = 0, []  # window: per-depth losses of the steps since the last log line
    if ckpt.latest_step() is not None:
      state, meta = ckpt.restore(ckpt.latest_step(), ts.abstract_state, data_iter)
      start, result = int(meta['step']), meta['result']
      window = [np.asarray(w) for w in meta['window']]
      self.log(f'{run.group}/{run.name}: resumed at step {start}')
    elif run.init_from:
      state, desc = partial_restore.init_from(run.init_from, config, _config_dict(config), state,
                                              ts.abstract_state, notify=lambda text: None)
      del desc
      result['init_from'] = os.path.relpath(run.init_from, self.workdir)  # no machine paths
    per_step = flops_per_step(config)
    ind_eval = self.induction_evals.get(run.group, self.induction_eval)
    if run.kind == 'induction' and start == 0:
      result['curve'].append({'step': 0, 'flops': 0.0, **ind_eval(ts, state)})
    t_start = time.time()
    for step in range(start + 1, run.steps + 1):
      state, m = steps_lib.run_step(ts, state, next_batch(step))
      m = jax.device_get({k: m[k] for k in ('loss_sum', 'count')})
      window.append(m['loss_sum'] / np.maximum(m['count'], 1))
      if step % run.log_every == 0 or step == run.steps:
        result['train_seconds'] += time.time() - t_start
        losses = np.mean(window, axis=0)
        point = {'step': step, 'flops': step * per_step, 'train_loss': losses.tolist()}
        if run.kind == 'induction' and (step % run.eval_every == 0 or step == run.steps):
          point.update(ind_eval(ts, state))
        result['curve'].append(point)
        window = []
        t_start = time.time()
      names = [name for name, at in run.eval_at.items() if at == step]
      if names:
        t0 = time.time()
        ev = {'step': step, 'flops': step * per_step, **self.lm_eval.teacher_forced(ts, state),
              'decode': self.lm_eval.decode(ts, state)}
        for name in names:
          result['evals'][name] = ev
        self.log(f'{run.group}/{run.name}: eval {"/".join(names)} @ {step}: stdlib bpb '
                 f'{ev["stdlib_val"]["bpb"][0]:.4f}  held-out bpb {ev["heldout"]["bpb"][0]:.4f} '
                 f'({time.time() - t0:.0f} s)')
        t_start = time.time()
      if step % run.save_every == 0 and step < run.steps:
        ckpt.save(step, state, data_iter, {'step': step, 'result': result,
                                           'window': [w.tolist() for w in window]}, force=True)
        t_start = time.time()
        if self.stop_at == step:
          ckpt.close()
          raise Interrupted(f'{run.name}: stopped after saving step {step}')
      if step == start + 1:  # the first step of a process compiles: not training time
        jax.block_until_ready(state)
        t_start = time.time()
    out = {'version': RESULT_VERSION, 'group': run.group, 'variant': run.variant,
           'seed': run.seed, 'kind': run.kind, 'steps': run.steps,
           'depth': int(config.model.mtp.depth),
           'mtp_kind': config.model.mtp.kind if config.model.mtp.depth else None,
           'tokens_per_step': config.data.batch_size * config.data.seq_len,
           'flops_per_step': per_step, 'eval_at': dict(run.eval_at),
           'config': _config_dict(config), **result, 'host': host_record()}
    if run.kind == 'lm':
      out['evaluation'] = self.lm_eval.describe
    else:
      out['task'] = dict(run.task)
    if run.keep_final:  # before the result: a run whose result exists has its final state
      # A state kept by an earlier training of this run (its result since removed) is
      # replaced: a checkpoints directory takes each step once.
      shutil.rmtree(run.keep_final, ignore_errors=True)
      final = Checkpointer(run.keep_final, max_to_keep=1, async_save=False)
      final.save(run.steps, state, meta={'step': run.steps, 'config': _config_dict(config),
                                         **integrity.integrity_meta(state)}, force=True)
      final.close()
    results_lib.save_result(self.out_dir, run.group, out)
    ckpt.close()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    self.log(f'{run.group}/{run.name}: done, {result["train_seconds"]:.0f} s of training '
             f'steps -> {self.result_path(run)}')
    return out


def has_final(run: Run) -> bool:
  """Whether the run's keep_final directory holds a saved state."""
  d = run.keep_final
  return bool(d) and os.path.isdir(d) and any(n.isdigit() for n in os.listdir(d))


def _resolved(config):
  """A copy of a run's config with the vocabulary size filled in, as its result records it."""
  return tokenizers.resolve_vocab_size(config.copy_and_resolve_references())


def _config_dict(config) -> dict:
  return json.loads(config.to_json_best_effort())


def same_config(saved: dict | None, now: dict) -> bool:
  """Whether a run saved with config `saved` is the run `now` describes: equal, except that
  a field added to the config after the run was saved may be missing from `saved` when
  `now` holds its default (base_config's value), as optional reads
  an older config."""
  return _same(saved, now, _config_dict(base_config()))


def _same(saved, now, default) -> bool:
  if not isinstance(saved, dict) or not isinstance(now, dict):
    return saved == now
  default = default if isinstance(default, dict) else {}
  for key, value in now.items():
    if key in saved:
      if not _same(saved[key], value, default.get(key)):
        return False
    elif key not in default or default[key] != value:
      return False
  return all(key in now for key in saved)


load_results = results_lib.load_results


# -- measuring the cost of a design (mtp_jax/research/design.py) ----------------------------------
def _timing_setup(config, devices):
  """(resolved config, TrainSetup, state, one batch of random tokens, the generator that drew
  it) on one device, for the cost measurements below: a step's cost does not depend on the
  data."""
  config = tokenizers.resolve_vocab_size(config.copy_and_resolve_references())
  ts, state = steps_lib.setup(config, (jax.devices() if devices is None else devices)[:1])
  rng = np.random.default_rng(0)
  b, t = config.data.batch_size, config.data.seq_len
  batch = {'tokens': rng.integers(2, config.model.vocab_size, (b, t)).astype(np.int32),
           'segment_ids': np.ones((b, t), np.int32),
           'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()}
  return config, ts, state, batch, rng


def measure_step_seconds(config, steps: int = 4, devices=None, repeats: int = 3) -> float:
  """Seconds per train step of `config` on one device: the fastest of `repeats` timings of
  `steps` steps of random tokens, after one untimed (compiling) step (on a shared machine
  the fastest timing is the one least slowed by other work). The cost of a step does not
  depend on the data."""
  config, ts, state, batch, _ = _timing_setup(config, devices)
  state, _ = steps_lib.run_step(ts, state, batch)
  jax.block_until_ready(state)
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      state, _ = steps_lib.run_step(ts, state, batch)
    jax.block_until_ready(state)
    best = min(best, (time.perf_counter() - t0) / steps)
  return best


def measure_induction_eval_seconds(config, evaluator: InductionEvaluator, devices=None) -> float:
  """Seconds of one evaluation of an induction evaluator on `config`'s model (after one
  untimed, compiling call)."""
  config = tokenizers.resolve_vocab_size(config.copy_and_resolve_references())
  ts, state = steps_lib.setup(config, (jax.devices() if devices is None else devices)[:1])
  evaluator(ts, state)
  t0 = time.perf_counter()
  evaluator(ts, state)
  return time.perf_counter() - t0


def measure_eval_seconds(config, *, eval_batches: int, sets: int, num_prompts: int,
                         prompt_len: int, new_tokens: int, temperatures: Sequence[float],
                         devices=None) -> float:
  """Seconds of one LMEvaluator pass of `config`'s model at initialisation: `sets` x
  eval_batches teacher-forced batches (timed on a few, scaled), and greedy decoding of the
  prompts once per temperature (an untrained model accepts almost nothing: the slow end)."""
  config, ts, state, batch, rng = _timing_setup(config, devices)
  with sharding.use_mesh(ts.mesh, ts.rules):
    tb = jax.device_put(jnp.ones((config.model.vocab_size,), jnp.int32),
                        sharding.replicated(ts.mesh))
    gb = sharding.host_batch_to_global(batch, ts.mesh)
    jax.block_until_ready(ts.eval_step(state, gb, tb))
    timed = min(4, eval_batches)
    t0 = time.perf_counter()
    for _ in range(timed):
      jax.block_until_ready(ts.eval_step(state, gb, tb))
    seconds = (time.perf_counter() - t0) / timed * eval_batches * sets
  dec = evaluation.local_decoder(ts.graphdef, state, ts.mesh)
  if dec.args.drafting_depths() and num_prompts:
    prompts = [list(rng.integers(2, config.model.vocab_size, prompt_len))
               for _ in range(num_prompts)]
    dec.generate(prompts, new_tokens, eos_id=None)  # compiles
    res = dec.generate(prompts, new_tokens, eos_id=None)
    seconds += res.seconds * len(temperatures)
  return seconds
