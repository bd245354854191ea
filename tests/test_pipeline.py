"""Pipeline parallelism (model/pipeline.py): the trunk as S stages x N microbatches over a
'stage' mesh axis is the unpipelined model's function: loss, per-depth losses, MoE
statistics and every gradient, on fake CPU devices; and its config refusals."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import dsv3_model_config, synthetic_batches, tiny_model_config
from mtp_jax import config_lib
from mtp_jax.errors import ConfigError
from mtp_jax.model import pipeline
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.mtp import MTPModel
from mtp_jax.runtime import sharding
from mtp_jax.train import loss as loss_lib


def _mesh(stage: int, fsdp: int = 1, data: int = 1):
  """A mesh of data x stage x fsdp fake devices with the default rules."""
  c = config_lib.base_config()
  c.mesh.axes = {'data': data, 'stage': stage, 'fsdp': fsdp, 'context': 1, 'tensor': 1}
  return sharding.make_mesh(c, jax.devices()[:data * stage * fsdp]), sharding.rules_of(c)


def _loss_and_grads(cfg, stages, micro, batch, weights, mesh=None, rules=None):
  args = dataclasses.replace(ModelArgs.from_config(cfg), pipeline_stages=stages,
                             pipeline_microbatches=micro)
  model = MTPModel(args, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def f(state):
    def loss(s):
      return loss_lib.loss_and_metrics(nnx.merge(graphdef, s), batch, weights,
                                       balance_weight=0.1)
    return jax.value_and_grad(loss, has_aux=True)(state)

  if mesh is None:
    (loss, sums), grads = jax.jit(f)(state)
  else:
    with sharding.use_mesh(mesh, rules):
      (loss, sums), grads = jax.jit(f)(state)
  return float(loss), {k: np.asarray(v) for k, v in sums.items()}, nnx.to_pure_dict(grads)


def _assert_same(ref, out, tol=1e-5):
  """Loss, every summed statistic and every gradient leaf within tol, relative to the
  largest magnitude of that quantity."""
  assert abs(out[0] - ref[0]) <= tol * abs(ref[0])
  for k in ref[1]:
    np.testing.assert_allclose(out[1][k], ref[1][k], rtol=0, atol=tol * max(
        1.0, float(np.abs(ref[1][k]).max())), err_msg=k)
  flat_ref = jax.tree_util.tree_flatten_with_path(ref[2])[0]
  flat_out = jax.tree.leaves(out[2])
  assert len(flat_ref) == len(flat_out)
  scale = max(float(np.abs(np.asarray(g)).max()) for _, g in flat_ref)
  for (path, g), h in zip(flat_ref, flat_out):
    g, h = np.asarray(g), np.asarray(h)
    np.testing.assert_allclose(h, g, rtol=0, atol=tol * max(float(np.abs(g).max()), 1e-3 * scale),
                               err_msg=jax.tree_util.keystr(path))


def _packed_batch(rows=8, seed=3):
  batch = synthetic_batches(1, rows, 16, vocab=64, seed=seed)[0]
  return {k: jnp.asarray(v) for k, v in batch.items()}


def test_stage_2_at_m3_on_four_devices_equals_the_unpipelined_step():
  """stage 2 x fsdp 2 on 4 fake devices, M = 3 sequential, packed documents, S and 2S
  microbatches: loss, per-depth sums and every gradient as without the pipeline."""
  cfg = tiny_model_config(3)
  cfg.model.n_layers = 4
  batch = _packed_batch()
  assert int(jnp.max(batch['segment_ids'])) > 1  # several documents in a row
  w = jnp.array([1.0, 0.3, 0.2, 0.1])
  ref = _loss_and_grads(cfg, 1, 0, batch, w)
  mesh, rules = _mesh(stage=2, fsdp=2)
  for micro in (2, 4):
    _assert_same(ref, _loss_and_grads(cfg, 2, micro, batch, w, mesh, rules))


@pytest.mark.parametrize('depth', [0, 1])
def test_four_stages_without_a_mesh_equal_the_unpipelined_step(depth):
  """S = 4 (no mesh: the same program unsharded), N in {S, 2S}, M in {0, 1}."""
  cfg = tiny_model_config(depth)
  cfg.model.n_layers = 4
  batch = _packed_batch()
  w = jnp.array([1.0, 0.3][:depth + 1])
  ref = _loss_and_grads(cfg, 1, 0, batch, w)
  for micro in (4, 8):
    _assert_same(ref, _loss_and_grads(cfg, 4, micro, batch, w))


@pytest.mark.slow  # MLA + MoE, two compiles on a 4-device mesh
def test_mla_moe_trunk_under_stage_2_equals_the_unpipelined_step():
  """MLA + DeepSeekMoE (a dense first layer before the pipeline, 2 MoE layers per stage),
  M = 3: loss, expert loads, balance terms and gradients as without the pipeline."""
  cfg = dsv3_model_config(3)
  cfg.model.n_layers = 5
  batch = _packed_batch()
  w = jnp.array([1.0, 0.3, 0.2, 0.1])
  ref = _loss_and_grads(cfg, 1, 0, batch, w)
  mesh, rules = _mesh(stage=2, fsdp=2)
  out = _loss_and_grads(cfg, 2, 2, batch, w, mesh, rules)
  assert ref[1]['moe_load'].shape == (7, 4)  # 4 MoE trunk layers and 3 MoE MTP blocks
  _assert_same(ref, out)


def test_bubble_fraction():
  assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
  assert pipeline.bubble_fraction(2, 4) == pytest.approx(1 / 5)


@pytest.mark.parametrize('fields, message', [
    ({'model.n_layers': 3}, 'do not divide into mesh.axes.stage = 2'),
    ({'model.pipeline_microbatches': -1}, 'model.pipeline_microbatches must be'),
    ({'model.pipeline_microbatches': 4}, "pipeline's 4 microbatches"),
    ({'mesh.axes': {'data': 4, 'stage': -1, 'fsdp': 1, 'context': 1, 'tensor': 1}},
     'mesh.axes.stage must be a positive integer'),
])
def test_pipeline_refusals_are_one_line(fields, message):
  cfg = tiny_model_config(1)
  cfg.model.n_layers = 4
  cfg.mesh.axes = {'data': -1, 'stage': 2, 'fsdp': 1, 'context': 1, 'tensor': 1}
  config_lib.validate(cfg, 8)
  for k, v in fields.items():
    section, name = k.split('.')
    cfg[section][name] = v
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.validate(cfg, 8)
  assert '\n' not in str(e.value)
