"""Model: shapes, finiteness, causality per depth, parameter naming, numpy agreement."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_reference as ref
from helpers import randomize, tiny_model_config
from mtp_jax.data import tokenizers
from mtp_jax.model import ModelArgs, MTPModel, count_params


def build(depth, kind='sequential', seed=0, **model):
  # Eager init: every tiny model shares shapes, so each init op compiles once per test run.
  config = tokenizers.resolve_vocab_size(tiny_model_config(depth, kind, **model))
  return MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(seed))


@nnx.jit
def forward(model, tokens, positions=None, segment_ids=None):
  hs = model(tokens, positions, segment_ids)
  return hs, [model.logits(h, k) for k, h in enumerate(hs)]


@pytest.mark.parametrize('depth', [0, 1, 3])
@pytest.mark.parametrize('kind', ['sequential', 'parallel'])
def test_shapes_and_finite(depth, kind):
  model = build(depth, kind)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)
  hs, all_logits = forward(model, tokens)
  assert len(hs) == depth + 1
  for h, logits in zip(hs, all_logits):
    assert h.shape == (2, 16, 32)
    assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
  counts = count_params(model)
  assert (counts['mtp'] == 0) == (depth == 0)
  assert counts['total'] == counts['trunk'] + counts['mtp']


def test_depth_zero_has_identical_trunk():
  """M = 0 is the same trunk: same parameter tree minus `mtp`, same h^0 and logits."""
  m0, m2 = build(0, seed=3), build(2, seed=3)
  s0 = nnx.to_pure_dict(nnx.state(m0, nnx.Param))
  s2 = nnx.to_pure_dict(nnx.state(m2, nnx.Param))
  s2.pop('mtp')
  s0.pop('mtp', None)
  assert jax.tree.structure(s0) == jax.tree.structure(s2)
  nnx.update(m2, nnx.state(m0, nnx.Param))  # load the trunk of m0 into m2 (mtp untouched)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  np.testing.assert_allclose(forward(m0, tokens)[1][0], forward(m2, tokens)[1][0],
                             rtol=1e-6, atol=1e-6)


def test_deepseek_parameter_names():
  model = build(2)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  layer = params['mtp'][1]
  assert set(layer) == {'enorm', 'hnorm', 'eh_proj', 'block', 'shared_head'}
  assert layer['eh_proj']['kernel'].shape == (64, 32)  # M_k: 2d -> d, no bias
  assert set(layer['shared_head']) == {'norm'}
  assert 'embed' not in layer and 'lm_head' not in layer  # Emb and OutHead are shared


@pytest.mark.parametrize('kind', ['sequential', 'parallel'])
def test_causality_per_depth(kind):
  """Depth k's output at i depends on tokens t_0..t_{i+k} only (sequential), t_0..t_i
  (parallel, main); and does depend on t_{i+k} (sequential: the chain's token input)."""
  depth, t = 3, 12
  model = build(depth, kind)
  # Float one-hot tokens make gradients w.r.t. every input token exist.
  object.__setattr__(model, 'embed_tokens', lambda onehot: onehot @ model.embed.embedding[...])
  tokens = jax.random.randint(jax.random.key(2), (1, t), 0, 64)
  onehot = jax.nn.one_hot(tokens, 64)
  probe = jnp.linspace(-1, 1, 64)
  for k in range(depth + 1):
    # jac[i, j, v] = d(output at i) / d(one-hot input j, v)
    jac = jax.jit(jax.jacrev(lambda x: model.logits(model(x)[k], k)[0] @ probe))(onehot)[:, 0]
    touched_TxT = np.abs(np.asarray(jac)).sum(-1) > 0
    for i in range(t):
      touched = np.nonzero(touched_TxT[i])[0]
      reach = i + k if (kind == 'sequential' and k > 0) else i
      assert touched.max() <= min(reach, t - 1), (k, i, touched)
      if reach < t:
        assert reach in touched, (k, i, touched)


@pytest.mark.parametrize('kind', ['sequential', 'parallel'])
def test_forward_matches_numpy(kind):
  model = build(2, kind, tie_embeddings=(kind == 'sequential'))
  params = randomize(model)
  tokens = np.array([[5, 9, 1, 33, 2, 7, 60, 4, 11, 12, 3, 8, 21, 22, 0, 0]])
  seg = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0]])
  pos = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1]])
  hs, logits = forward(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg))
  want = ref.forward(params, tokens[0], pos[0], seg[0], 2, kind)
  for k in range(3):
    np.testing.assert_allclose(np.asarray(hs[k][0]), want[k], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[k][0]),
                               ref.head_logits(params, want[k], k), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_rope_halves_swapped_by_matmul_equal_the_slices_bit_for_bit(dtype):
  """apply_rope's matmul swap (the TPU kernels' layers use it) gives the slice form's
  values exactly, at head width 128 (llama-3 scaling) and MLA's rope width 64."""
  from mtp_jax.model import layers
  rng = np.random.default_rng(0)
  pos = jnp.asarray(rng.integers(0, 8192, size=(2, 5)))
  for h, scaling in [(128, ('llama3', 8.0, 1.0, 4.0, 8192)), (64, ())]:
    x = jnp.asarray(rng.normal(size=(2, 5, 3, h)) * 10, dtype)
    want = jax.jit(lambda x, p: layers.apply_rope(x, p, 500000.0, scaling))(x, pos)
    got = jax.jit(lambda x, p: layers.apply_rope(x, p, 500000.0, scaling, True))(x, pos)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_norm_backward_reads_its_cotangent_written_out_on_tpu_only():
  """RMSNorm's closed-form backward puts an optimization barrier on its incoming gradient
  in a program traced for TPU (matmul.unfused_cotangent: the compiler would otherwise fuse
  the norm's float32 backward into the matmul that made dy), and none on CPU; the values
  are the same either way."""
  from mtp_jax.model import layers
  from mtp_jax.train.aot.devices import traced_for
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
  scale = jnp.asarray(rng.normal(size=(16,)), jnp.float32)

  def loss(x, scale):
    return jnp.sum(jnp.sin(layers.rms_normalize(x, scale, 1e-6, jnp.float32)))

  grad = jax.grad(loss, argnums=(0, 1))
  assert 'optimization_barrier' not in str(jax.make_jaxpr(grad)(x, scale))
  jax.clear_caches()  # the backward's trace is cached per function, whatever the backend
  with traced_for('tpu'):
    tpu_jaxpr = str(jax.make_jaxpr(grad)(x, scale))
    tpu_grads = jax.jit(grad).lower(x, scale)  # traced for TPU, compiled for nothing
  assert tpu_jaxpr.count('optimization_barrier') == 1
  assert 'optimization_barrier' in tpu_grads.as_text()
  jax.clear_caches()
  want = jax.grad(lambda x, s: jnp.sum(jnp.sin(layers.rms_normalize_autodiff(
      x, s, 1e-6, jnp.float32))), argnums=(0, 1))(x, scale)
  for g, w in zip(grad(x, scale), want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
