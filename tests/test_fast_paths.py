"""Speed paths must not change the math: the blocked attention core, the cached CPU peak."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import load_config, packed_segments, tiny_model_config
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import attention as attn_lib
from mtp_jax.model import layers
from mtp_jax.model.blocks import remat_policy
from mtp_jax.model.mtp import ModelArgs, MTPModel
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train import loss as loss_lib


def _packed_segments(b, t, seed=0):
  """Rows of 1-3 packed documents and a little padding (segment 0)."""
  return jnp.asarray(packed_segments(b, t, seed))


@pytest.mark.parametrize('t,block,n,kv', [(40, 16, 4, 2), (32, 8, 2, 2), (24, 64, 4, 1)])
def test_blocked_attention_matches_library_call_with_gradients(t, block, n, kv):
  """Uneven last block (40 / 16), GQA, a block larger than T; packed rows (segment ids)."""
  b, h = 3, 8
  rng = np.random.default_rng(1)
  q, g = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((b, t, kv, h)), jnp.float32) for _ in range(2))
  mask = attn_lib.attention_mask(_packed_segments(b, t))

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2)))

  ref = loss(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask))(q, k, v)
  got = loss(lambda q, k, v: attn_lib.blocked_causal_attention(q, k, v, mask, block))(q, k, v)
  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-5, atol=2e-5)


def _assert_blocked_equals_xla(c, model_overrides, check):
  """Loss and every gradient of the M = 2 model on packed rows: the 'blocked' attention
  core (with its model overrides) against 'xla'; check(model, impl) inspects each model."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 16)), jnp.int32)
  seg = _packed_segments(2, 16, seed=3)
  pos = jnp.asarray(np.concatenate([np.arange(5), np.arange(11)])[None].repeat(2, 0), jnp.int32)
  batch = {'tokens': tokens * (seg > 0), 'segment_ids': seg, 'positions': pos}
  out = {}
  for impl, overrides in model_overrides.items():
    c.model.attention_core, c.model.attention_block = impl, 4
    for key, value in overrides.items():
      c.model[key] = value
    model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(c)), rngs=nnx.Rngs(0))
    check(model, impl)
    graphdef, state = nnx.split(model)

    def f(state):
      model = nnx.merge(graphdef, state)
      return loss_lib.loss_and_metrics(model, batch, jnp.array([1., .3, .3]))[0]
    out[impl] = jax.jit(jax.value_and_grad(f))(state)
  np.testing.assert_allclose(out['blocked'][0], out['xla'][0], rtol=1e-5)
  for a, r in zip(jax.tree.leaves(out['blocked'][1]), jax.tree.leaves(out['xla'][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-4, atol=1e-6)


def test_model_loss_and_gradients_agree_across_attention_paths():
  """The whole MTP model (M = 2, GQA, packed rows): loss and every gradient, xla vs blocked."""
  c = tiny_model_config(2)

  def check(model, impl):
    assert model.layers[0].self_attn.impl == impl

  _assert_blocked_equals_xla(c, {'xla': {}, 'blocked': {}}, check)


@pytest.mark.parametrize('t,block', [(40, 16), (24, 64)])
def test_saved_core_matches_library_call_with_gradients_under_block_remat(t, block):
  """The custom-VJP core (saved output and row log-sum-exp, flash-style backward): values
  and q/k/v gradients equal jax.nn.dot_product_attention's, plain and under the block
  remat policy that saves its residuals by name; uneven last block, packed rows."""
  b, n, h = 3, 2, 8
  rng = np.random.default_rng(2)
  q, k, v, g = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(4))
  mask = attn_lib.attention_mask(_packed_segments(b, t, seed=1))

  def value_and_grads(fn):
    f = jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * g), argnums=(0, 1, 2))
    return jax.jit(f)(q, k, v)

  ref = value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask))
  core = lambda q, k, v: attn_lib.blocked_causal_attention(q, k, v, mask, block, saved_core=True)
  for fn in (core, jax.checkpoint(core, policy=remat_policy('block'))):
    for a, r in zip(jax.tree.leaves(value_and_grads(fn)), jax.tree.leaves(ref)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_block_remat_saves_the_core_output_and_never_reruns_its_forward():
  """Under remat='block' the custom-VJP core's output and log-sum-exp are saved by name:
  the backward recomputes only the block probabilities (one exp per query block), where a
  policy without those names reruns the forward too (two exps per block)."""
  b, t, n, h, block = 2, 32, 2, 8, 16
  q = k = v = jnp.ones((b, t, n, h), jnp.float32)
  mask = attn_lib.attention_mask(jnp.ones((b, t), jnp.int32))
  core = lambda q, k, v: attn_lib.blocked_causal_attention(q, k, v, mask, block, saved_core=True)

  def exps(policy):
    f = jax.checkpoint(core, policy=policy)
    text = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))).lower(
        q, k, v).as_text()
    return text.count('stablehlo.exponential')

  blocks = t // block
  assert exps(remat_policy('block')) == 2 * blocks  # forward once + backward once
  assert exps(jax.checkpoint_policies.dots_with_no_batch_dims_saveable) == 3 * blocks


def test_model_with_block_remat_and_saved_core_agrees_with_library_attention():
  """No GQA (the saved core's case), M = 2, packed rows: remat='block' with the blocked
  core gives the loss and every gradient of the library call without remat."""
  c = tiny_model_config(2, n_kv_heads=4)

  def check(model, impl):
    assert model.layers[0].self_attn.saved_core == (impl == 'blocked')

  _assert_blocked_equals_xla(c, {'xla': {'remat': 'none'}, 'blocked': {'remat': 'block'}}, check)


def test_attention_auto_is_blocked_on_cpu_only():
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(tiny_model_config(1)))
  assert attn_lib.attention_impl(args) == ('blocked' if jax.default_backend() == 'cpu' else 'xla')
  xla = tokenizers.resolve_vocab_size(tiny_model_config(1, attention_core='xla'))
  assert attn_lib.attention_impl(ModelArgs.from_config(xla)) == 'xla'


@pytest.mark.parametrize('name', ['gpu_350m', 'tpu_pod_1b'])
@pytest.mark.parametrize('impl', ['xla', 'blocked'])
def test_pod_configs_lower_a_train_gradient_with_each_attention_path(name, impl):
  """The full-size model's loss gradient traces and lowers (abstract params, no compile)."""
  c = load_config(name)
  c.model.attention_core = impl
  c.model.n_layers = 2  # the scanned block is traced once; depth only repeats it
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(c))
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0))))
  b, t = 1, c.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32)
           for k in ('tokens', 'segment_ids', 'positions')}

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
  monkeypatch.setenv(peak_lib.CACHE_DIR_ENV, str(tmp_path))
  monkeypatch.delenv(peak_lib.PEAK_ENV, raising=False)
  readings = iter([100e9, 300e9, 200e9] * 10 + [50e9] * 100)
  monkeypatch.setattr(peak_lib, 'matmul_probe', lambda *a, **k: next(readings))
  first = peak_lib.cpu_peak()
  assert first['flops'] == 300e9 and first['date'] and len(first['load_average']) == 2
  assert peak_lib.cpu_peak()['flops'] == 300e9  # read from disk, not probed again
  assert next(readings) == 100e9  # exactly one probe round (rounds x sizes) was taken
  stored = json.loads(pathlib.Path(tmp_path, 'cpu_peak_flops.json').read_text())
  assert list(stored.values())[0]['flops'] == 300e9
  assert peak_lib.update_cpu_peak()['flops'] == 300e9  # a lower (loaded) probe never lowers it
  peak, source = peak_lib.peak_flops(jnp.float32, jax.devices())
  assert peak == 300e9 and 'cached' in source  # 8 fake devices, one process
  monkeypatch.setenv(peak_lib.PEAK_ENV, '1e12')
  assert peak_lib.peak_flops(jnp.float32, jax.devices())[0] == 1e12


@pytest.mark.parametrize('remat', [False, True])
def test_rms_norm_custom_vjp_matches_library_norm(remat):
  """layers.rms_normalize_vjp: value and x / scale gradients of nnx.RMSNorm (its autodiff),
  also inside jax.checkpoint under the block remat policy."""
  rng = np.random.default_rng(0)
  x, dy = (jnp.asarray(rng.standard_normal((2, 5, 16)) * 3, jnp.float32) for _ in range(2))
  scale = jnp.asarray(rng.standard_normal(16), jnp.float32)
  ref = nnx.RMSNorm(16, epsilon=1e-6, rngs=nnx.Rngs(0))
  graphdef, _ = nnx.split(ref)

  def loss_ref(x, s):
    return jnp.sum(nnx.merge(graphdef, nnx.State({'scale': nnx.Param(s)}))(x) * dy)

  def loss_vjp(x, s):
    return jnp.sum(layers.rms_normalize_vjp(x, s, 1e-6, jnp.float32) * dy)

  wrap = (lambda f: jax.checkpoint(f, policy=remat_policy('block'))) if remat else (lambda f: f)
  ref_v, ref_g = jax.jit(jax.value_and_grad(wrap(loss_ref), (0, 1)))(x, scale)
  got_v, got_g = jax.jit(jax.value_and_grad(wrap(loss_vjp), (0, 1)))(x, scale)
  np.testing.assert_allclose(got_v, ref_v, rtol=1e-6)
  for a, r in zip(got_g, ref_g):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-5, atol=2e-6)




def test_remat_policies_keep_what_they_name_and_change_no_gradient(capsys):
  """block_inputs gives one block's output and gradients of no remat (the others keep less
  of the same values); the saved residuals (jax's own list) hold the RMSNorm outputs and
  row rsqrts under block_norms and block_inputs, the SwiGLU product under block_mlp and
  block_inputs, neither under block."""
  c = tiny_model_config(1, attention_core='xla')
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(c)), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model.layers[0])
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 32)), jnp.float32)
  pos = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
  mask = attn_lib.attention_mask(_packed_segments(2, 16))
  out, names = {}, {}
  for remat in config_lib.REMAT_POLICIES:
    policy = remat_policy(remat)

    def f(state, x, policy=policy):
      fn = lambda s, x: nnx.merge(graphdef, s)(x, pos, mask)[0]  # noqa: E731
      fn = fn if policy is None else jax.checkpoint(fn, policy=policy)
      return jnp.sum(jnp.sin(fn(state, x)))
    if remat in ('none', 'block_inputs'):  # the one that keeps every name, against none
      out[remat] = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(state, x)
    jax.ad_checkpoint.print_saved_residuals(f, state, x)
    saved = capsys.readouterr().out
    names[remat] = {n: saved.count(f"named '{n}'")
                    for n in (layers.NORM_SAVED_NAME, layers.MLP_SAVED_NAME)}
  for loss, grads in out.values():
    np.testing.assert_allclose(loss, out['none'][0], rtol=1e-6)
    for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(out['none'][1])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-6)
  norms, mlp = layers.NORM_SAVED_NAME, layers.MLP_SAVED_NAME
  assert names['block'] == names['full'] == {norms: 0, mlp: 0}
  assert names['block_norms'] == {norms: 4, mlp: 0}  # two outputs, two row rsqrts
  assert names['block_mlp'] == {norms: 0, mlp: 1}
  assert names['block_inputs'] == {norms: 4, mlp: 1}
