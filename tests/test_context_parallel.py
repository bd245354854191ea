"""Context parallelism (model/context.py): the sequence split over a `context` mesh axis in
the load-balanced order computes the unsharded step exactly, MTP's shifts included."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (
  dsv3_model_config,
  load_config,
  loss_batch,
  loss_grads,
  synthetic_batches,
  tiny_model_config,
)
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import context as context_lib
from mtp_jax.model.mtp import ModelArgs, MTPModel, shift_left
from mtp_jax.runtime import sharding
from mtp_jax.train import loss as loss_lib
from mtp_jax.train import train_and_evaluate
from mtp_jax.train.steps import loss_args


def test_balanced_order_and_shifts_in_the_natural_order():
  """Shard i holds chunks i and 2n-1-i; a shift in the layout is the natural shift."""
  order = context_lib.balanced_order(16, 2)
  np.testing.assert_array_equal(order, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  order = context_lib.balanced_order(16, 4)
  np.testing.assert_array_equal(order.reshape(4, 4)[:, [0, 2]], [[0, 14], [2, 12], [4, 10],
                                                                  [6, 8]])
  layout = context_lib.Layout(16, ('context',), 4)
  x = jnp.arange(100, 132).reshape(2, 16)
  for k in (1, 3, 7, 20):
    natural = np.asarray(shift_left(x, k, fill=-1))
    got = layout.shift_left(layout.to_layout(x), k, fill=-1)
    np.testing.assert_array_equal(np.asarray(layout.to_natural(got)), natural)
  with pytest.raises(ValueError, match='divisible by 8'):
    context_lib.Layout(12, ('context',), 4)


def _model_config(case):
  depth, kind, block = case['depth'], case.get('kind', 'sequential'), case.get('block', 'dense')
  c = dsv3_model_config(depth) if block == 'mla_moe' else tiny_model_config(depth, kind)
  c.model.mtp.kind = kind
  for field, value in case.get('mtp', {}).items():
    c.model.mtp[field] = value
  if 'core' in case:
    c.model.attention_core = case['core']
  return c


def _batch(packed: bool, seq_len: int = 16):
  if seq_len == 16:
    b = loss_batch(3)
  else:
    rows = synthetic_batches(1, 2, seq_len, vocab=64, seed=3)[0]
    b = {k: jnp.asarray(v) for k, v in rows.items()}
  if not packed:  # one document a row, no padding, positions implied
    return {'tokens': jnp.where(b['tokens'] == 0, 5, b['tokens']),
            'segment_ids': jnp.ones_like(b['segment_ids'])}
  return b


def _compare(config, axes: dict, packed: bool, seq_len: int = 16, rtol=1e-5):
  """loss, every per-depth sum and every gradient of the step on `axes` (context > 1)
  against the same step without a mesh."""
  config.data.seq_len = seq_len
  for a, s in axes.items():
    config.mesh.axes[a] = s
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(config))
  model = MTPModel(args, rngs=nnx.Rngs(2))
  la = loss_args(config)
  w = loss_lib.depth_weights(la, 0)
  batch = _batch(packed, seq_len)
  (l1, s1), g1 = loss_grads(model, batch, w, chunk=4)
  n = int(np.prod(list(axes.values())))
  config.mesh.axes.data = axes.get('data', 1)
  mesh = sharding.make_mesh(config, jax.devices()[:n])
  assert mesh.shape['context'] == axes['context']
  with sharding.use_mesh(mesh, sharding.rules_of(config)):
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    jaxpr = str(jax.make_jaxpr(lambda p: loss_lib.loss_and_metrics(
        nnx.merge(graph, p, rest), batch, w, chunk=4))(params))
    (l2, s2), g2 = loss_grads(model, batch, w, chunk=4)
  assert 'shard_map' in jaxpr and 'axis_index' in jaxpr  # queries local, keys gathered
  np.testing.assert_allclose(float(l2), float(l1), rtol=rtol)
  for k in ('loss_sum', 'correct', 'count', 'agree'):
    np.testing.assert_allclose(np.asarray(s2[k]), np.asarray(s1[k]), rtol=rtol, err_msg=k)
  leaves1, leaves2 = jax.tree.leaves(g1), jax.tree.leaves(g2)
  assert len(leaves1) == len(leaves2) > 0
  scale = max(float(jnp.max(jnp.abs(a))) for a in leaves1)
  for a, b in zip(leaves1, leaves2):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=rtol * scale)
  return float(l1)


def test_context_2_on_4_devices_at_m3_packed_equals_unsharded():
  """The step with the sequence on 2 context shards beside data 2 (4 devices), M = 3
  sequential depths, packed documents with padding: loss, per-depth sums, gradients."""
  _compare(_model_config({'depth': 3}), {'data': 2, 'context': 2}, packed=True)


CASES = [  # (model, mesh axes, packed)
    ({'depth': 0}, {'context': 2, 'tensor': 2}, True),
    ({'depth': 1}, {'fsdp': 2, 'context': 4}, False),
    ({'depth': 3, 'kind': 'parallel'}, {'context': 4}, True),
    ({'depth': 3, 'mtp': {'target_offsets': (2, 4, 5), 'strict_leaps': True}},
     {'data': 2, 'context': 2}, True),
    ({'depth': 1, 'block': 'mla_moe'}, {'data': 2, 'context': 2}, True),
    ({'depth': 3, 'block': 'mla_moe'}, {'context': 4}, False),
    ({'depth': 1, 'kind': 'top'}, {'context': 2}, True),
    ({'depth': 2, 'core': 'xla'}, {'context': 2, 'tensor': 2}, True),
]


@pytest.mark.parametrize('case,axes,packed', CASES, ids=[
    'm0-ctx2-tensor2', 'm1-ctx4-fsdp2-unpacked', 'parallel-m3-ctx4', 'leaps-m3-ctx2-data2',
    'mla_moe-m1-ctx2-data2', 'mla_moe-m3-ctx4-unpacked', 'top-ctx2', 'xla-m2-ctx2-tensor2'])
def test_context_parallel_step_equals_unsharded(case, axes, packed):
  _compare(_model_config(case), axes, packed)


def test_context_parallel_splash_kernel_equals_unsharded():
  """The splash kernel (Pallas interpret mode here) under context 2: block tables split
  per shard, keys back in the natural order; the same step as without a mesh."""
  c = _model_config({'depth': 1, 'core': 'splash'})
  c.model.n_layers = 1
  c.model.attention_block_q = c.model.attention_block_kv = 128
  _compare(c, {'context': 2}, packed=True, seq_len=256)


def test_context_size_is_checked_before_compiling():
  c = tiny_model_config(1)
  c.mesh.axes.context = 4
  c.data.seq_len = 20
  with pytest.raises(config_lib.ConfigError, match=r'data\.seq_len \(20\) must be divisible by '
                     r'2 x the context axis \(8\)'):
    config_lib.validate(c, num_devices=8)
  c.data.seq_len = 256
  c.model.attention_core = 'splash'
  c.model.attention_block_q = 128
  c.mesh.axes.context = 4  # 64 tokens a shard: not a whole splash block of 128
  with pytest.raises(config_lib.ConfigError, match='per context shard'):
    config_lib.validate(c, num_devices=8)


def _tiny(data_dir, context: int, **train_fields):
  c = load_config('tiny')
  c.data.data_dir = data_dir
  c.train.progress = False
  c.mesh.axes.data, c.mesh.axes.context = 2 // context, context
  for k, v in train_fields.items():
    c.train[k] = v
  return c


def _losses(workdir):
  rows = [json.loads(line) for line in pathlib.Path(workdir, 'metrics.jsonl').read_text()
          .splitlines()]
  return {r['step']: r['train/loss'] for r in rows if 'train/loss' in r}


@pytest.mark.slow
def test_tiny_run_on_context_2_writes_the_losses_of_context_1_and_resumes_across(
    devices, stdlib_data_dir, tmp_path):
  """configs/tiny.py for 20 steps on 2 devices: data 2 against context 2, the same
  metrics.jsonl losses; a checkpoint written at step 10 on context 2 resumes on data 2."""
  fields = dict(steps=20, log_every=1, eval_every=0, checkpoint_every=10, eval_batches=1)
  one, two, moved = (str(tmp_path / n) for n in ('one', 'two', 'moved'))
  train_and_evaluate(_tiny(stdlib_data_dir, 1, **fields), one, devices=devices[:2])
  train_and_evaluate(_tiny(stdlib_data_dir, 2, **fields), two, devices=devices[:2])
  train_and_evaluate(_tiny(stdlib_data_dir, 2, **fields), moved, devices=devices[:2],
                     stop_after=10)
  train_and_evaluate(_tiny(stdlib_data_dir, 1, **fields), moved, devices=devices[:2])
  a, b, c = _losses(one), _losses(two), _losses(moved)
  assert sorted(a) == sorted(b) == sorted(c) == list(range(1, 21))
  np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-5)
  np.testing.assert_allclose([c[s] for s in a], [a[s] for s in a], rtol=1e-5)
