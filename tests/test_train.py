"""Training: gradient accumulation, 1 vs 8 devices, checkpoint resume, the entry script."""
import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import load_config, synthetic_batches
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax.config_lib import ConfigError
from mtp_jax.train import steps as steps_lib
from mtp_jax.train import train_and_evaluate


def tiny_config(data_dir, **train_fields):
  c = load_config('tiny')
  c.data.data_dir = data_dir
  c.train.progress = False
  for k, v in train_fields.items():
    c.train[k] = v
  return c


def params_of(state):
  model_state = state[0]
  from flax import nnx
  return jax.tree.map(np.asarray, nnx.to_pure_dict(model_state))


def test_grad_accumulation_equals_one_big_batch(devices, stdlib_data_dir):
  config = tiny_config(stdlib_data_dir)
  ts, state = steps_lib.setup(config, devices[:1])
  copy = jax.tree.map(jnp.copy, state)
  batch = synthetic_batches(1, 8, 64)[0]
  new_big, m_big = steps_lib.run_step(ts, state, batch)
  config.train.grad_accum = 2
  args = steps_lib.StepArgs.from_config(config)
  step2 = jax.jit(functools.partial(steps_lib.train_step, args, ts.graphdef), donate_argnums=0)
  ts2 = steps_lib.TrainSetup(**{**ts.__dict__, 'config': config, 'train_step': step2})
  new_acc, m_acc = steps_lib.run_step(ts2, copy, batch)
  np.testing.assert_allclose(float(m_big['loss']), float(m_acc['loss']), rtol=1e-6)
  np.testing.assert_allclose(float(m_big['grad_norm']), float(m_acc['grad_norm']), rtol=1e-5)
  for key in ('count', 'correct', 'agree'):
    np.testing.assert_array_equal(np.asarray(m_big[key]), np.asarray(m_acc[key]))
  for a, b in zip(jax.tree.leaves(params_of(new_big)), jax.tree.leaves(params_of(new_acc))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_one_device_equals_eight_devices(devices, stdlib_data_dir):
  """The same steps on 1 device and on a 2x2x2 (data, fsdp, tensor) mesh of 8."""
  batches = synthetic_batches(4, 8, 64, seed=1)
  losses, finals = {}, {}
  for name, devs, shape in [('one', devices[:1], (1, 1, 1)), ('eight', devices, (2, 2, 2))]:
    config = tiny_config(stdlib_data_dir)
    config.mesh.shape = shape
    ts, state = steps_lib.setup(config, devs)
    assert ts.mesh.devices.size == len(devs)
    run = []
    for b in batches:
      state, m = steps_lib.run_step(ts, state, b)
      run.append(float(m['loss']))
    losses[name], finals[name] = run, params_of(state)
  assert losses['one'][-1] < losses['one'][0]
  np.testing.assert_allclose(losses['one'], losses['eight'], rtol=2e-5)
  for a, b in zip(jax.tree.leaves(finals['one']), jax.tree.leaves(finals['eight'])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def _train_losses(workdir):
  text = pathlib.Path(workdir, 'metrics.jsonl').read_text()
  rows = [json.loads(line) for line in text.splitlines()]
  return {r['step']: r['train/loss'] for r in rows if 'train/loss' in r}


def _final_params(workdir, config, devices):
  ts, state = steps_lib.setup(config, devices)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'))
  restored, meta = ckpt.restore(ckpt.latest_step(), ts.abstract_state)
  ckpt.close()
  return meta['step'], params_of(restored)


def test_checkpoint_resume_is_exact(devices, stdlib_data_dir, tmp_path):
  """6 steps straight == 3 steps, stop, resume, 3 steps: same losses, same parameters."""
  fields = dict(steps=6, log_every=1, eval_every=0, checkpoint_every=0, eval_batches=1)
  full, split = str(tmp_path / 'full'), str(tmp_path / 'split')
  train_and_evaluate(tiny_config(stdlib_data_dir, **fields), full, devices=devices[:1])
  train_and_evaluate(tiny_config(stdlib_data_dir, **fields), split, devices=devices[:1],
                           stop_after=3)
  assert ckpt_lib.CheckpointReader(os.path.join(split, 'checkpoints')).steps()[-1] == 3
  train_and_evaluate(tiny_config(stdlib_data_dir, **fields), split, devices=devices[:1])
  a, b = _train_losses(full), _train_losses(split)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  assert a == b  # same data order and same arithmetic, step by step
  step_a, pa = _final_params(full, tiny_config(stdlib_data_dir, **fields), devices[:1])
  step_b, pb = _final_params(split, tiny_config(stdlib_data_dir, **fields), devices[:1])
  assert step_a == step_b == 6
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(x, y)

  bad = tiny_config(stdlib_data_dir, **fields)
  bad.model.mtp.depth = 1
  with pytest.raises(ConfigError, match='incompatible config.*model.mtp.depth'):
    train_and_evaluate(bad, full, devices=devices[:1])


def test_train_script_smoke(tiny_run):
  """scripts/train.py on configs/tiny.py: the loss falls and every output is written."""
  workdir, proc = tiny_run
  assert 'step' in proc.stderr and 'tok/s' in proc.stderr  # the live progress line
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train_rows = [r for r in rows if 'train/loss' in r]
  eval_rows = [r for r in rows if 'eval/loss_main' in r]
  assert train_rows[-1]['train/loss'] < train_rows[0]['train/loss'] - 0.5
  for key in ('train/loss_main', 'train/loss_mtp_1', 'train/loss_mtp_2', 'train/acc_main',
              'train/acc_mtp_2', 'train/agree_mtp_1', 'train/lr', 'perf/tokens_per_sec'):
    assert key in train_rows[-1], key
  assert train_rows[-1]['train/loss_mtp_2'] > 0
  assert [r['step'] for r in eval_rows] == [20, 40]
  for key in ('eval/bpb_main', 'eval/bpb_mtp_1', 'eval/bpb_mtp_2', 'eval/agree_mtp_2'):
    assert 0 < eval_rows[-1][key] < 10, key
  assert json.loads(pathlib.Path(workdir / 'config.json').read_text())['model']['mtp']['depth'] == 2
  assert any(f.startswith('events') for f in os.listdir(workdir / 'tensorboard'))
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['20', '40']


def test_optimizer_settings_are_inputs_of_the_update():
  """AdamW's b1, b2, weight_decay and grad_clip come with each update (like the schedule):
  the update equals optax.adamw's with the values given, and the lowered program is the same
  whatever the config's values are, so a rerun with other values hits the compile cache."""
  import optax  # pylint: disable=g-import-not-at-top

  from mtp_jax.train_state import build_optimizer  # pylint: disable=g-import-not-at-top
  from mtp_jax.train_state.optimizer import lr_at, schedule_inputs  # pylint: disable=g-import-not-at-top
  params = {'w': jnp.arange(6.0).reshape(2, 3) / 7, 'norm': jnp.ones(3)}
  grads = {'w': jnp.full((2, 3), 3.0), 'norm': jnp.linspace(-1, 1, 3)}

  def config_with(**fields):
    c = load_config('tiny')
    for k, v in fields.items():
      c.train[k] = v
    return c

  a = config_with(b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=1.0)
  b = config_with(b1=0.7, b2=0.99, weight_decay=0.3, grad_clip=0.5)
  lowered = []
  for config in (a, b):
    opt = build_optimizer(config)
    fn = jax.jit(lambda g, s, p, sched, opt=opt: opt.update(g, s, p, schedule=sched))
    lowered.append(fn.lower(grads, opt.init(params), params,
                            schedule_inputs(config)).as_text())
  assert lowered[0] == lowered[1]
  opt, t = build_optimizer(a), b.train  # a's program, b's values
  state = opt.init(params)
  ref = optax.chain(optax.clip_by_global_norm(t.grad_clip), optax.adamw(
      lambda n: lr_at(n, schedule_inputs(b)), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
      mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  ref_state = ref.init(params)
  for _ in range(3):
    got, state = opt.update(grads, state, params, schedule=schedule_inputs(b))
    want, ref_state = ref.update(grads, ref_state, params)
    for k in params:
      np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-9)
  assert jax.tree.structure(state) == jax.tree.structure(ref_state)
