"""Speed paths must not change the math: the blocked attention core, the cached CPU peak."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import load_config, tiny_model_config
from mtp_jax import flops, layers
from mtp_jax import loss as loss_lib
from mtp_jax.model import MTPModel, ModelArgs


def _packed_segments(b, t, seed=0):
  """Rows of 1-3 packed documents and a little padding (segment 0)."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    cuts = np.sort(rng.choice(np.arange(1, t - 2), size=2, replace=False))
    seg[r, :cuts[0]], seg[r, cuts[0]:cuts[1]], seg[r, cuts[1]:t - 2] = 1, 2, 3
  return jnp.asarray(seg)


@pytest.mark.parametrize('t,block,n,kv', [(40, 16, 4, 2), (32, 8, 2, 2), (24, 64, 4, 1)])
def test_blocked_attention_matches_library_call_with_gradients(t, block, n, kv):
  """Uneven last block (40 / 16), GQA, a block larger than T; packed rows (segment ids)."""
  b, h = 3, 8
  rng = np.random.default_rng(1)
  q, g = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32) for _ in range(2))
  mask = layers.attention_mask(_packed_segments(b, t))

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))

  ref = loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask))(q, k, v)
  got = loss(lambda q, k, v: layers.blocked_causal_attention(q, k, v, mask, block))(q, k, v)
  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_model_loss_and_gradients_agree_across_attention_paths():
  """The whole MTP model (D = 2, GQA, packed rows): loss and every gradient, xla vs blocked."""
  c = tiny_model_config(2)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 16)), jnp.int32)
  seg = _packed_segments(2, 16, seed=3)
  pos = jnp.asarray(np.concatenate([np.arange(5), np.arange(11)])[None].repeat(2, 0), jnp.int32)
  batch = {'tokens': tokens * (seg > 0), 'segment_ids': seg, 'positions': pos}
  out = {}
  for impl in ('xla', 'blocked'):
    c.model.attention_core, c.model.attention_block = impl, 4
    model = MTPModel(ModelArgs.from_config(c), rngs=nnx.Rngs(0))
    assert model.layers[0].self_attn.impl == impl
    graphdef, state = nnx.split(model)

    def f(state):
      return loss_lib.loss_and_metrics(nnx.merge(graphdef, state), batch, jnp.array([1., .3, .3]))[0]
    out[impl] = jax.jit(jax.value_and_grad(f))(state)
  np.testing.assert_allclose(out['blocked'][0], out['xla'][0], rtol=1e-5)
  for a, r in zip(jax.tree.leaves(out['blocked'][1]), jax.tree.leaves(out['xla'][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-4, atol=1e-6)


def test_attention_auto_is_blocked_on_cpu_only():
  args = ModelArgs.from_config(tiny_model_config(1))
  assert layers.attention_impl(args) == ('blocked' if jax.default_backend() == 'cpu' else 'xla')
  assert layers.attention_impl(ModelArgs.from_config(tiny_model_config(1, attention_core='xla'))) == 'xla'


@pytest.mark.parametrize('name', ['gpu_350m', 'tpu_pod_1b'])
@pytest.mark.parametrize('impl', ['xla', 'blocked'])
def test_pod_configs_lower_a_train_gradient_with_each_attention_path(name, impl):
  """The full-size model's loss gradient traces and lowers (abstract params, no compile)."""
  c = load_config(name)
  c.model.attention_core = impl
  c.model.n_layers = 2  # the scanned block is traced once; depth only repeats it
  args = ModelArgs.from_config(c)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0))))
  b, t = 1, c.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32) for k in ('tokens', 'segment_ids', 'positions')}

  def grad(state, batch):
    model = nnx.merge(graphdef, state)
    return jax.grad(lambda m: loss_lib.loss_and_metrics(
        m, batch, jnp.ones(args.mtp_depth + 1), chunk=c.model.loss_chunk)[0])(model)

  text = jax.jit(grad).lower(abstract, batch).as_text()
  assert ('dot_general' in text) and len(text) > 10_000
  # the blocked path's first query block sees only `attention_block` keys
  blk = c.model.attention_block
  assert (f'{blk}x{blk}xf' in text or f'{blk}x{blk}xbf' in text) == (impl == 'blocked')


def test_cpu_peak_is_cached_and_only_raised(tmp_path, monkeypatch):
  monkeypatch.setenv(flops.CACHE_DIR_ENV, str(tmp_path))
  monkeypatch.delenv(flops.PEAK_ENV, raising=False)
  readings = iter([100e9, 300e9, 200e9] * 10 + [50e9] * 100)
  monkeypatch.setattr(flops, 'matmul_probe', lambda *a, **k: next(readings))
  first = flops.cpu_peak()
  assert first['flops'] == 300e9 and first['date'] and len(first['load_average']) == 2
  assert flops.cpu_peak()['flops'] == 300e9  # read from disk, not probed again
  assert next(readings) == 100e9  # exactly one probe round (rounds x sizes) was taken
  stored = json.load(open(os.path.join(tmp_path, 'cpu_peak_flops.json')))
  assert list(stored.values())[0]['flops'] == 300e9
  assert flops.update_cpu_peak()['flops'] == 300e9  # a lower (loaded) probe never lowers it
  peak, source = flops.peak_flops(jnp.float32, jax.devices())
  assert peak == 300e9 and 'cached' in source  # 8 fake devices, one process
  monkeypatch.setenv(flops.PEAK_ENV, '1e12')
  assert flops.peak_flops(jnp.float32, jax.devices())[0] == 1e12
