"""The Pallas attention kernels (splash for TPU, the Triton flash kernel for GPU), run in
Pallas interpret mode on CPU: values and gradients against the blocked core and the float64
numpy reference on packed rows, GQA and MLA shapes, the MTP model at M = 3, training steps,
the block remat policy, and the configs the kernels cannot take."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_reference as ref
from helpers import (
  dsv3_model_config,
  load_config,
  packed_segments,
  randomize,
  synthetic_batches,
  tiny_model_config,
)
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.errors import ConfigError
from mtp_jax.model import ModelArgs, MTPModel
from mtp_jax.model import attention as attn_lib
from mtp_jax.runtime import sharding
from mtp_jax.train import loss as loss_lib
from mtp_jax.train import steps as steps_lib

KERNELS = ['splash', 'triton']
T = 128  # the smallest sequence both kernels take (a multiple of 128)


def _segments(b, t, seed=0):
  """Rows of three packed documents (cut at random, across block borders) and padding."""
  return packed_segments(b, t, seed, cuts_from=5, cuts_before=t - 8, padding=3)


@pytest.mark.parametrize('impl', KERNELS)
@pytest.mark.parametrize('kv,v_width', [(2, 16), (4, 10)], ids=['gqa', 'mla_widths'])
def test_kernel_matches_blocked_core_and_numpy(impl, kv, v_width):
  """Output and q / k / v gradients on packed rows of T = 256 (two 128-blocks): GQA (4
  query heads on 2 kv heads), and MLA's shape (one kv head per query head, values
  narrower than queries / keys: 10 against 16)."""
  b, t, n, h = 2, 256, 4, 16
  rng = np.random.default_rng(0)
  q = rng.standard_normal((b, t, n, h)).astype(np.float32)
  k = rng.standard_normal((b, t, kv, h)).astype(np.float32)
  v = rng.standard_normal((b, t, kv, v_width)).astype(np.float32)
  g = rng.standard_normal((b, t, n, v_width)).astype(np.float32)
  seg = _segments(b, t)
  scale = 1 / np.sqrt(h)

  def value_and_grads(core):
    f = jax.value_and_grad(lambda q, k, v: jnp.sum(core(q, k, v) * g), argnums=(0, 1, 2))
    out = jax.jit(lambda q, k, v: (core(q, k, v), f(q, k, v)[1]))(q, k, v)
    return [np.asarray(x) for x in jax.tree.leaves(out)]

  got = value_and_grads(lambda q, k, v: attn_lib.kernel_attention(
      impl, q, k, v, jnp.asarray(seg), scale, 128, 128))
  mask = attn_lib.attention_mask(jnp.asarray(seg))

  def blocked(q, k, v):  # one head width in the blocked core: v zero-padded, then sliced
    v_pad = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, h - v_width)))
    return attn_lib.blocked_causal_attention(q, k, v_pad, mask, 64)[..., :v_width]

  for a, r in zip(got, value_and_grads(blocked)):
    np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-5)
  for row in range(b):
    want = ref.causal_attention(*(x[row].astype(np.float64) for x in (q, k, v)), seg[row],
                                scale, g[row].astype(np.float64))
    for a, r in zip(got, want):
      np.testing.assert_allclose(a[row], r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('impl', KERNELS)
def test_kernel_at_head_width_128_in_bfloat16(impl):
  """The shapes the kernels run at on accelerators: heads 128 wide, bfloat16 q / k / v,
  GQA (2 query heads on 1 kv head), a packed row of T = 128. Against the float64 reference
  on the same bf16-rounded inputs, the output and each gradient stay within 2^-6 of the
  reference's largest magnitude (bf16 keeps 8 bits: 2^-8 relative per rounding, and the
  kernels round p and dS to bf16 before their products); measured: at most 2^-7.5 (dk)."""
  b, t, n, kv, h = 1, 128, 2, 1, 128
  rng = np.random.default_rng(3)
  bf = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
  q, k, v, g = bf(b, t, n, h), bf(b, t, kv, h), bf(b, t, kv, h), bf(b, t, n, h)
  seg = _segments(b, t, seed=3)
  scale = 1 / np.sqrt(h)

  def f(q, k, v):
    out = attn_lib.kernel_attention(impl, q, k, v, jnp.asarray(seg), scale, 128, 128)
    return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), out

  (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert out.dtype == jnp.bfloat16 and all(x.dtype == jnp.bfloat16 for x in grads)
  f64 = lambda x: np.asarray(x[0], np.float64)  # noqa: E731
  want = ref.causal_attention(f64(q), f64(k), f64(v), seg[0], scale, f64(g))
  for name, a, r in zip(('out', 'dq', 'dk', 'dv'), (out, *grads), want):
    err = np.abs(np.asarray(a[0], np.float64) - r).max()
    assert err <= 2 ** -6 * np.abs(r).max(), (name, err, np.abs(r).max())


def _model(impl, attention='gqa', depth=3, **model):
  if attention == 'mla':
    c = dsv3_model_config(depth, mlp='dense')
  else:
    c = tiny_model_config(depth)
  c.model.attention_core = impl
  c.model.attention_block_q = c.model.attention_block_kv = 128
  for key, value in model.items():
    c.model[key] = value
  c.data.seq_len = T
  return MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(c)), rngs=nnx.Rngs(0))


def _batch(b=2, seed=0):
  seg = _segments(b, T, seed)
  pos = np.zeros_like(seg)
  for r in range(b):
    for s in np.unique(seg[r]):
      pos[r, seg[r] == s] = np.arange(np.sum(seg[r] == s))
  tokens = np.where(seg > 0, np.random.default_rng(seed).integers(1, 64, seg.shape), 0)
  return {'tokens': tokens.astype(np.int32), 'segment_ids': seg, 'positions': pos}


@pytest.mark.parametrize('impl', KERNELS)
@pytest.mark.parametrize('attention', ['gqa', 'mla'])
def test_model_with_kernel_matches_numpy_at_depth_3(impl, attention):
  """The MTP model (trunk and three MTP blocks) with each kernel core: hidden states of
  every depth equal the numpy reference's on a packed row (GQA, and MLA with dv != dn + dr)."""
  model = _model(impl, attention)
  assert model.layers[0].self_attn.impl == impl
  params = randomize(model)
  b = _batch(1)
  hs = nnx.jit(lambda m, t, p, s: m(t, p, s))(
      model, *(jnp.asarray(b[k]) for k in ('tokens', 'positions', 'segment_ids')))
  want = ref.forward(params, b['tokens'][0], b['positions'][0], b['segment_ids'][0], 3)
  for k in range(4):
    np.testing.assert_allclose(np.asarray(hs[k][0]), want[k], rtol=2e-4, atol=2e-4)


def _loss_and_grads(model, batch):
  graphdef, state = nnx.split(model)
  weights = jnp.array([1.0] + [0.3] * model.args.mtp_depth)
  batch = {k: jnp.asarray(v) for k, v in batch.items()}

  def f(state):
    return loss_lib.loss_and_metrics(nnx.merge(graphdef, state), batch, weights)[0]
  return jax.jit(jax.value_and_grad(f))(state)


# MLA's kernel gradients at its widths are checked fast above (mla_widths); its model here is slow
@pytest.mark.parametrize('attention', ['gqa', pytest.param('mla', marks=pytest.mark.slow)])
def test_splash_loss_and_gradients_match_blocked_under_block_remat_and_scan(attention):
  """M = 2, remat block (the kernel's residuals saved by name), scanned layers and depths:
  the loss and every parameter gradient equal those of the blocked core (GQA) or the
  library call (MLA, which has no blocked form)."""
  other = 'blocked' if attention == 'gqa' else 'xla'
  out = {impl: _loss_and_grads(_model(impl, attention, 2, remat='block', scan_layers=True),
                               _batch(1, seed=1)) for impl in ('splash', other)}
  np.testing.assert_allclose(out['splash'][0], out[other][0], rtol=1e-5)
  for a, r in zip(jax.tree.leaves(out['splash'][1]), jax.tree.leaves(out[other][1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=2e-4, atol=2e-6)


def _kernel_calls(jaxpr) -> int:
  """pallas_call equations in a jaxpr and every jaxpr nested in it."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == 'pallas_call'
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _kernel_calls(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _kernel_calls(sub)
  return count


@pytest.mark.parametrize('impl', KERNELS)
def test_block_remat_keeps_the_kernel_residuals(impl, devices):
  """The gradient of the M = 3 model (5 attention layers) on a data 2 x fsdp 2 x tensor 2
  mesh: without remat and under remat='block' 5 forward + 10 backward kernel calls (the
  forward's output and residuals saved, never recomputed); remat='full' reruns the 5
  forwards. Traced only."""
  counts = {}
  for remat in ('none', 'block', 'full'):
    model = _model(impl, remat=remat)
    graphdef, state = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in _batch(4).items()}
    config = tiny_model_config(3)
    config.mesh.shape = (2, 2, 2)
    mesh = sharding.make_mesh(config, devices)

    def f(state):
      return loss_lib.loss_and_metrics(nnx.merge(graphdef, state), batch, jnp.ones(4))[0]
    with sharding.use_mesh(mesh, sharding.rules_of(config)):
      counts[remat] = _kernel_calls(jax.make_jaxpr(jax.grad(f))(state).jaxpr)
  assert counts == {'none': 15, 'block': 15, 'full': 20}


def _train(config, devices, batches):
  ts, state = steps_lib.setup(config, devices)
  out = []
  for batch in batches:
    state, m = steps_lib.run_step(ts, state, batch)
    out.append((float(m['loss']), float(m['grad_norm'])))
  return np.array(out)


def test_three_training_steps_with_splash_match_blocked(devices):
  """configs/tiny.py (M = 1, 4 x 128 tokens) on a data 2 x fsdp 2 x tensor 2 mesh (the kernel
  per shard in jax.shard_map: rows over data x fsdp, heads over tensor): loss and gradient norm of
  three steps with attention_core=splash equal blocked's (relative 1e-5)."""
  batches = synthetic_batches(3, 4, T, vocab=64, seed=2)
  runs = {}
  for impl in ('splash', 'blocked'):
    c = load_config('tiny')
    c.model.vocab_size, c.model.mtp.depth, c.mesh.shape = 64, 1, (2, 2, 2)
    c.data.seq_len, c.data.batch_size = T, 4
    c.model.attention_core = impl
    c.model.attention_block_q = c.model.attention_block_kv = 128
    runs[impl] = _train(c, devices, batches)
  np.testing.assert_allclose(runs['splash'], runs['blocked'], rtol=1e-5)


@pytest.mark.parametrize('core,seq_len,block,match', [
    ('splash', 200, 512, r'data.seq_len \(200\) to be a multiple of model.attention_block_q'),
    ('splash', 1024, 384, r'model.attention_block_q \(384\)'),
    ('splash', 1536, 1024, r'data.seq_len \(1536\) to be a multiple of model.attention_block_q'),
    ('triton', 200, 512, r'data.seq_len \(200\) to be a multiple of 128'),
    ('triton', 1024, 512, r'heads up to 512 wide .*got 640'),
])
def test_configs_a_kernel_cannot_take_fail_validation_in_one_line(core, seq_len, block, match):
  c = tiny_model_config(1, attention_core=core, attention_block_q=block)
  c.data.seq_len = seq_len
  if 'wide' in match:  # a head the Triton kernel's tiles were never compiled for
    c.model.head_dim = 640
  with pytest.raises(ConfigError, match=match) as e:
    config_lib.validate(c)
  assert '\n' not in str(e.value)
  c.model.attention_core = 'blocked'
  config_lib.validate(c)  # the blocked core takes any length


def test_kernel_call_refuses_a_length_it_cannot_take_before_compiling():
  """'auto' resolves to a kernel on an accelerator after validation: the call itself
  raises the same one line while tracing."""
  x = jax.ShapeDtypeStruct((1, 200, 2, 16), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, 200), jnp.int32)
  fn = functools.partial(attn_lib.kernel_attention, 'splash', scale=0.25)
  with pytest.raises(ConfigError, match=r'attention_core=splash needs data.seq_len \(200\)'):
    jax.eval_shape(lambda q, k, v, s: fn(q, k, v, s), x, x, x, seg)


def test_triton_blocks_shrink_with_the_head_width():
  """Blocks that compiled for an H100 (128 x 128 forward at width 256 did not fit its
  shared memory): 64 / 128 -> forward 128 x 128, backward dkv 32 x 128 and dq 128 x 32 (not
  32 x 32); MLA's 192 (padded to 256) -> 128 x 64, 32 x 64, 64 x 32; 512 -> 64 x 32, 32 x 32.
  The fused backward needs the dkv key block to equal the dq query block."""
  small, mla, wide = (128, 128, 32, 128, 128, 32), (128, 64, 32, 64, 64, 32), (64, 32) + (32,) * 4
  assert [config_lib.triton_blocks(w) for w in (64, 128, 192, 256, 512, 513)] == [
      small, small, mla, mla, wide, None]
  for width, blocks in config_lib.TRITON_BLOCKS:
    assert blocks[3] == blocks[4], width


def test_auto_picks_the_backend_kernel():
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(tiny_model_config(1)))
  assert attn_lib.AUTO_CORES == {'cpu': 'blocked', 'tpu': 'splash', 'gpu': 'triton',
                                 'cuda': 'triton'}
  assert attn_lib.attention_impl(args) == attn_lib.AUTO_CORES[jax.default_backend()]
