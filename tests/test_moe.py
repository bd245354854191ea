"""DeepSeekMoE (mtp_jax/model/moe.py): numpy agreement with routing bias, aux-loss-free balancing,
the balance loss, training, and the 1 / 8-device equality with experts sharded."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import numpy_reference as ref
from helpers import (
  dsv3_model_config,
  params_with_routing_bias,
  set_field,
  step_losses,
  synthetic_batches,
)
from mtp_jax import config_lib
from mtp_jax.data import tokenizers
from mtp_jax.interop import fp8
from mtp_jax.model import ModelArgs, MTPModel, moe, moe_exchange
from mtp_jax.runtime import sharding
from mtp_jax.train import flops
from mtp_jax.train import loss as loss_lib
from mtp_jax.train import steps as steps_lib

TOKENS = np.array([[5, 9, 1, 33, 2, 7, 60, 4, 11, 12, 3, 8, 21, 22, 0, 0],
                   [3, 3, 40, 41, 42, 6, 7, 8, 50, 1, 2, 9, 9, 9, 10, 63]])
SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 0, 0], [1] * 16])
POS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1], list(range(16))])
TOP_K, SCALING = 2, 2.5  # dsv3_model_config's


def build(seed=0, **kw):
  config = tokenizers.resolve_vocab_size(dsv3_model_config(1, **kw))
  return MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(seed))


def test_layout_and_non_trainable_bias():
  """Layer 0 dense, layer 1 and the MTP block MoE; the bias is state, not a Param."""
  model = build()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert 'gate_proj' in params['layers'][0]['mlp']
  mlp = params['layers'][1]['mlp']
  assert set(mlp) == {'gate', 'experts', 'shared_experts'}
  assert mlp['experts']['gate_proj'].shape == (4, 32, 16)
  assert mlp['gate']['kernel'].shape == (32, 4)
  assert 'e_score_correction_bias' not in mlp['gate']
  assert 'experts' in params['mtp'][0]['block']['mlp']
  biases = jax.tree.leaves(nnx.state(model, moe.RoutingBias))
  assert len(biases) == 2 and all(b.shape == (4,) for b in biases)


def test_moe_model_matches_numpy_and_the_bias_only_selects():
  """Forward (MLA + dense, MLA + MoE trunk, MLA + MoE MTP block), per-layer load and the
  sequence-wise balance loss equal the numpy reference, with biases that change the
  selection; the same biases never enter the gates (the reference gates from s alone)."""
  model = build()
  params = params_with_routing_bias(model, scale=0.3)
  batch = {'tokens': jnp.asarray(TOKENS), 'positions': jnp.asarray(POS),
           'segment_ids': jnp.asarray(SEG)}

  @nnx.jit
  def run(m):
    hs = m(batch['tokens'], batch['positions'], batch['segment_ids'])
    return hs, moe.collect(m)

  hs, stats = run(model)
  want_load = np.zeros((2, 4))
  want_bal = np.zeros(2)
  changed = 0
  for r in range(2):
    want = ref.forward(params, TOKENS[r], POS[r], SEG[r], 1, moe=(TOP_K, SCALING))
    for k in range(2):
      np.testing.assert_allclose(np.asarray(hs[k][r]), want[k], rtol=2e-4, atol=2e-4)
    # The MoE inputs: layer 1's post-attention normed stream, and the MTP block's.
    for j, p in enumerate([params['layers'][1], params['mtp'][0]['block']]):
      x_in = _moe_input(params, p, TOKENS[r], POS[r], SEG[r], j, want)
      bal, load = ref.moe_balance(p['mlp'], x_in, TOP_K, SCALING)
      want_bal[j] += bal / 2
      want_load[j] += load
      no_bias = dict(p['mlp'], gate=dict(p['mlp']['gate'], e_score_correction_bias=np.zeros(4)))
      changed += sum(set(a[0]) != set(b[0]) for a, b in zip(
          ref.moe_route(p['mlp'], x_in, TOP_K, SCALING),
          ref.moe_route(no_bias, x_in, TOP_K, SCALING)))
  assert changed > 0  # the biases do move some tokens to other experts
  order = _moe_order(model)
  np.testing.assert_array_equal(np.asarray(stats['moe_load']), want_load[order])
  np.testing.assert_allclose(np.asarray(stats['moe_balance']), want_bal[order], rtol=1e-4)


def _moe_order(model):
  """moe.collect's layer order as indices into [trunk layer 1, MTP block]."""
  mods = moe.moe_modules(model)
  return [0 if m is model.layers[1].mlp else 1 for m in mods]


def _moe_input(params, p, tokens, pos, seg, j, want):
  """RMSNorm'd residual stream entering block p's MoE, from the reference's pieces."""
  eps, theta = 1e-6, 1e4
  if j == 0:
    x = ref.block(params['layers'][0], params['embed']['embedding'][tokens], pos, seg, eps, theta)
  else:
    m = params['mtp'][0]
    t = len(tokens)
    shifted = np.array([tokens[i + 1] if i + 1 < t else 0 for i in range(t)])
    e = ref.rmsnorm(params['embed']['embedding'][shifted], m['enorm']['scale'], eps)
    x = (np.concatenate([e, ref.rmsnorm(want[0], m['hnorm']['scale'], eps)], -1)
         @ m['eh_proj']['kernel'])
  h = ref.rmsnorm(x, p['input_layernorm']['scale'], eps)
  x = x + ref.mla_attention(p['self_attn'], h, pos, seg, eps, theta)
  return ref.rmsnorm(x, p['post_attention_layernorm']['scale'], eps)


def test_node_limited_routing_matches_numpy():
  """n_group / topk_group (DeepSeek-V3's node-limited routing): the MoE layer equals the
  numpy reference, every token's experts lie in at most topk_group groups, and the limit
  does change some selections against plain top-k."""
  model = build(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2)
  layer = model.layers[1].mlp
  d = layer.gate.kernel.shape[0]
  bias = np.random.default_rng(1).normal(0, 0.05, 16).astype(np.float32)
  layer.gate.e_score_correction_bias[...] = jnp.asarray(bias)
  x = np.random.default_rng(2).normal(0, 1, (2, 12, d)).astype(np.float32)
  m = {'gate': {'kernel': np.asarray(layer.gate.kernel[...]), 'e_score_correction_bias': bias},
       'experts': {n: np.asarray(getattr(layer.experts, n)[...])
                   for n in ('gate_proj', 'up_proj', 'down_proj')},
       'shared_experts': {n: {'kernel': np.asarray(getattr(layer.shared_experts, n).kernel[...])}
                          for n in ('gate_proj', 'up_proj', 'down_proj')}}
  got = np.asarray(nnx.jit(lambda mod, v: mod(v))(layer, jnp.asarray(x)))
  want = np.stack([ref.moe_mlp(m, xr, 3, 2.5, 4, 2) for xr in x])
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
  flat = x.reshape(-1, d)
  limited = ref.moe_route(m, flat, 3, 2.5, 4, 2)
  plain = ref.moe_route(m, flat, 3, 2.5)
  assert all(len({i // 4 for i in c}) <= 2 for c, _, _ in limited)
  assert sum(set(a[0]) != set(b[0]) for a, b in zip(limited, plain)) > 0
  # The jitted route picks the reference's experts, token by token.
  scores = 1 / (1 + np.exp(-(flat @ m['gate']['kernel'])))
  idx, _ = moe.route(jnp.asarray(scores), jnp.asarray(bias), 3, 2.5, 4, 2)
  assert [set(r) for r in np.asarray(idx).tolist()] == [set(c) for c, _, _ in limited]


@pytest.mark.parametrize('kw', [{}, dict(n_routed_experts=16, num_experts_per_tok=3,
                                         n_group=4, topk_group=2)], ids=['top2', 'node-limited'])
def test_moe_decode_matches_the_forward(kw):
  """MoE.decode (decode layout; gathered experts for N K <= E rows, the grouped dispatch
  above) == MoE.__call__ on the same rows, routing bias included; no statistics left."""
  model = build(**kw)
  layer = model.layers[1].mlp
  e = layer.num_experts
  layer.gate.e_score_correction_bias[...] = jnp.asarray(
      np.random.default_rng(1).normal(0, 0.3, e).astype(np.float32))
  dec = nnx.merge(*nnx.split(layer))
  dec.prepare_decode()
  assert not hasattr(dec.gate, 'kernel') and dec.gate_t.shape == (e, 32)
  rng = np.random.default_rng(3)
  for rows in (1, 2, 8):  # 2 x rows x K <= E: gathered, else grouped
    x = jnp.asarray(rng.normal(size=(2, rows, 32)).astype(np.float32))
    want = nnx.jit(lambda mod, v: mod(v))(layer, x)
    got = nnx.jit(lambda mod, v: mod.decode(v))(dec, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=f'{rows} rows')
  assert not jax.tree.leaves(nnx.state(dec, nnx.Intermediate))


def test_block_dispatch_equals_ragged_dot_forward_and_grads():
  """The CPU 'blocks' grouped matmul and lax.ragged_dot agree, values and gradients, on
  uneven groups with an empty expert; block_layout keeps each expert's rows in its own
  blocks."""
  model = build(n_routed_experts=6, num_experts_per_tok=2)
  experts = model.layers[1].mlp.experts
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(20, experts.gate_proj.shape[1])).astype(np.float32))
  idx = jnp.asarray(rng.choice([0, 1, 1, 2, 4, 4, 4, 5], size=(20, 2)))  # expert 3: empty

  def f(dispatch):
    def loss(ex, xx):
      y = moe.grouped_swiglu(xx, idx, ex, 6, jnp.float32, dispatch)
      return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
    return nnx.value_and_grad(loss, argnums=(0, 1))(experts, x)

  (va, (ga, gxa)), (vb, (gb, gxb)) = f('ragged'), f('blocks')
  np.testing.assert_allclose(float(vb), float(va), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gxb), np.asarray(gxa), rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(ga)), jax.tree.leaves(nnx.state(gb))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
  sizes = jnp.bincount(idx.reshape(-1), length=6)
  slot, expert_of_block, n_blocks = moe.block_layout(sizes, 40, 8)
  owner = np.asarray(expert_of_block)[np.asarray(slot) // 8]
  assert list(owner) == sorted(np.asarray(idx).reshape(-1).tolist())
  assert len(set(np.asarray(slot).tolist())) == 40 and n_blocks == 5 + 6


def test_update_bias_direction():
  model = build()
  load = jnp.array([[10., 2., 4., 0.], [3., 3., 3., 3.]])
  out = moe.update_bias(model, load, 0.01)
  b = [np.asarray(m.gate.e_score_correction_bias[...]) for m in moe.moe_modules(model)]
  np.testing.assert_allclose(b[0], [-0.01, 0.01, 0.0, 0.01], atol=1e-7)  # mean load 4
  np.testing.assert_allclose(b[1], 0.0)  # perfectly even: no move
  np.testing.assert_allclose(np.asarray(out['moe_bias_min']), [-0.01, 0.0], atol=1e-7)


def test_balance_loss_prefers_even_routing():
  """sum f_i P_i is 1 for uniform routing and larger when one expert takes every token."""
  even = jnp.full((1, 4, 4), 0.5)
  idx_even = jnp.array([[[0, 1], [2, 3], [0, 1], [2, 3]]])
  np.testing.assert_allclose(float(moe.balance_loss(even, idx_even)), 1.0, rtol=1e-6)
  skew = jnp.array([[[0.9, 0.9, 0.1, 0.1]] * 4])
  idx_skew = jnp.array([[[0, 1]] * 4])
  assert float(moe.balance_loss(skew, idx_skew)) > 1.5


def test_tiny_mla_moe_trains_and_balances(devices):
  """A few jitted train steps: finite, falling loss, a positive MTP loss, the bias moved by
  exactly rate x sign(mean load - load) of the step's own load, balance loss in the loss."""
  config = dsv3_model_config(1)
  config.mesh.shape = (1, 1, 1)
  config.train.lr, config.train.warmup_steps = 1e-2, 0
  config.model.moe.bias_update_rate = 0.01
  ts, state = steps_lib.setup(config, devices[:1])
  bias = lambda s: [np.asarray(x) for x in jax.tree.leaves(
      nnx.state(nnx.merge(ts.graphdef, s)[0], moe.RoutingBias))]
  losses = []
  batches = synthetic_batches(1, 8, 16, vocab=64, seed=1) * 6
  for batch in batches:
    before = bias(state)
    state, m = steps_lib.run_step(ts, state, batch)
    losses.append(float(m['loss']))
    after = bias(state)
    load = np.asarray(m['moe_load'])
    assert load.sum(-1).tolist() == [8 * 16 * 2] * 2  # every (token, expert) pair, dropless
    for j, (b0, b1) in enumerate(zip(before, after)):
      np.testing.assert_allclose(b1 - b0, 0.01 * np.sign(load[j].mean() - load[j]), atol=1e-6)
    assert float(m['moe_balance'].min()) > 0
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert float(m['loss_sum'][1]) > 0
  logged = moe.log_metrics(jax.device_get(m))
  assert logged['train/moe_load_max_over_mean_l0'] >= 1.0
  assert logged['train/moe_bias_max_l0'] > 0 > logged['train/moe_bias_min_l0']


def test_balance_loss_enters_the_loss():
  model = build()
  b = {'tokens': jnp.asarray(TOKENS), 'positions': jnp.asarray(POS),
       'segment_ids': jnp.asarray(SEG)}
  w = jnp.array([1.0, 0.3])
  l0, s0 = nnx.jit(lambda m: loss_lib.loss_and_metrics(m, b, w))(model)
  l1, _ = nnx.jit(lambda m: loss_lib.loss_and_metrics(m, b, w, balance_weight=0.5))(model)
  np.testing.assert_allclose(float(l1 - l0), 0.5 * float(s0['moe_balance'].sum()), rtol=1e-4)


@pytest.mark.slow  # four compiles of an MLA + MoE loss and its gradient: ~60 s loaded
def test_scan_layers_with_moe_equals_the_loop():
  """scan_layers over a dense layer + a run of 2 MoE layers and M = 2 MoE MTP depths, with
  full remat: the same loss, gradients, per-layer expert loads and balance terms as the
  unrolled loop."""
  batch = {k: jnp.asarray(v) for k, v in synthetic_batches(1, 4, 16, vocab=64, seed=5)[0].items()}
  w = jnp.array([1.0, 0.3, 0.3])
  out = {}
  for scan in (False, True):
    cfg = dsv3_model_config(2)
    cfg.model.n_layers, cfg.model.scan_layers, cfg.model.remat = 3, scan, 'full'
    config_lib.validate(cfg)
    model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(cfg)), rngs=nnx.Rngs(0))
    params_with_routing_bias(model)

    @nnx.jit
    def run(m):
      (loss, metrics), grads = nnx.value_and_grad(
          lambda mm: loss_lib.loss_and_metrics(mm, batch, w, balance_weight=0.1),
          has_aux=True)(m)
      return loss, metrics, grads

    loss, metrics, grads = run(model)
    out[scan] = (float(loss), np.asarray(metrics['moe_load']),
                 np.asarray(metrics['moe_balance']), jax.tree.leaves(nnx.state(grads)))
  (l0, load0, bal0, g0), (l1, load1, bal1, g1) = out[False], out[True]
  assert load0.shape == (4, 4)  # layers 1, 2 and both MTP blocks
  np.testing.assert_array_equal(load1, load0)
  np.testing.assert_allclose(bal1, bal0, rtol=1e-5)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for a, b in zip(g0, g1):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def _ws(experts):
  return [w[...] for w in (experts.gate_proj, experts.up_proj, experts.down_proj)]


@pytest.mark.parametrize('form', ['ragged', 'gmm'])
def test_grouped_product_forms_agree_with_rows_past_the_groups(form):
  """The three grouped-matmul forms on rows sorted by expert, with an empty expert and 9 of
  40 rows in no group (as the expert-parallel dispatch hands over the rows of other
  devices' experts): the same products, zero rows past the groups, the same gradients
  for weights and rows. 'gmm' is the TPU kernel, run here in Pallas's interpret mode."""
  experts = build(n_routed_experts=8).layers[1].mlp.experts
  rng = np.random.default_rng(2)
  xs = jnp.asarray(rng.normal(size=(40, 32)).astype(np.float32))
  sizes = jnp.array([3, 0, 9, 5, 1, 7, 0, 6], jnp.int32)
  kw = {'interpret': True} if form == 'gmm' else {}
  f = lambda ws, xs, form, kw: jnp.sum(jnp.sin(moe.grouped_products(xs, sizes, ws, form, **kw)))  # noqa: E731
  y = moe.grouped_products(xs, sizes, _ws(experts), form, **kw)
  y_blocks = moe.grouped_products(xs, sizes, _ws(experts), 'blocks')
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_blocks), rtol=1e-5, atol=1e-6)
  assert not np.asarray(y_blocks)[31:].any() and not np.asarray(y)[31:].any()
  g = jax.grad(f, argnums=(0, 1))(_ws(experts), xs, form, kw)
  g_blocks = jax.grad(f, argnums=(0, 1))(_ws(experts), xs, 'blocks', {})
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_blocks)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  assert not np.asarray(g[1])[31:].any()  # rows of no group get no gradient


def test_unread_rows_past_the_groups_reach_no_row_and_no_weight():
  """The TPU kernel (interpret mode) with rows past the groups left unmasked, as the
  exchange hands them over: NaN in those rows of the input and of the output's cotangent
  changes no row in a group, no weight gradient and no group row's input gradient."""
  experts = build(n_routed_experts=8).layers[1].mlp.experts
  rng = np.random.default_rng(3)
  xs = rng.normal(size=(40, 32)).astype(np.float32)
  sizes = jnp.array([3, 0, 9, 5, 1, 7, 0, 6], jnp.int32)
  ct = rng.normal(size=(40, 32)).astype(np.float32)
  garbage_xs, garbage_ct = xs.copy(), ct.copy()
  garbage_xs[31:], garbage_ct[31:] = np.nan, np.nan
  clean_ct = ct.copy()
  clean_ct[31:] = 0

  def run(xs, ct, **kw):
    y, vjp = jax.vjp(lambda ws, xs: moe.grouped_products(xs, sizes, ws, **kw), _ws(experts),
                     jnp.asarray(xs))
    return y, vjp(jnp.asarray(ct))

  y, (g_ws, g_xs) = run(garbage_xs, garbage_ct, form='gmm', interpret=True,
                        rows_past_groups_read=False)
  y_ref, (g_ws_ref, g_xs_ref) = run(xs, clean_ct, form='blocks')
  np.testing.assert_allclose(np.asarray(y)[:31], np.asarray(y_ref)[:31], rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g_ws), jax.tree.leaves(g_ws_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(g_xs)[:31], np.asarray(g_xs_ref)[:31], rtol=1e-4,
                             atol=1e-6)


@pytest.mark.parametrize('shape,exchange', [((2, 2, 2), 'all_to_all'), ((8, 1, 1), 'all_to_all'),
                                            ((2, 2, 2), 'all_gather'), ((8, 1, 1), 'all_gather')])
def test_expert_parallel_dispatch_equals_the_global_one(devices, shape, exchange):
  """Under a mesh each device multiplies only its own experts' rows (the experts over
  'data': 4 of 8 per device at (2, 2, 2), one at (8, 1, 1)), its rows sent there by the
  ragged all-to-all exchange (CPU: its emulation) or all-gathered: the layer's output and
  its gradients for weights and inputs are those of the global sort-based dispatch
  without a mesh."""
  config = dsv3_model_config(1, n_routed_experts=8, num_experts_per_tok=2)
  config.model.moe.exchange = exchange
  layer = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)),
                   rngs=nnx.Rngs(0)).layers[1].mlp
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 6, 32)).astype(np.float32))

  def loss(layer, x):
    y = layer(x)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

  grad = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  (_, y0), (gl0, gx0) = grad(layer, x)
  config.mesh.shape = shape
  mesh = sharding.make_mesh(config, devices)
  with sharding.use_mesh(mesh, sharding.rules_of(config)):
    assert moe.expert_layout()['expert'] == ('data',)
    (_, y1), (gl1, gx1) = nnx.jit(grad)(layer, x)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(gx1), np.asarray(gx0), rtol=1e-4, atol=1e-6)
  for a, b in zip(jax.tree.leaves(nnx.state(gl0, nnx.Param)),
                  jax.tree.leaves(nnx.state(gl1, nnx.Param))):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # two compiles of the MLA + MoE step, one on 8 devices: ~50 s loaded
def test_one_and_eight_devices_agree_with_experts_sharded(devices):
  """The expert axis over 'data' (4 experts on 2 ways), fsdp and tensor too: same losses."""
  batches = synthetic_batches(2, 8, 16, vocab=64, seed=3)
  losses = {}
  for name, devs, shape in [('one', devices[:1], (1, 1, 1)), ('eight', devices, (2, 2, 2))]:
    config = dsv3_model_config(1)
    config.mesh.shape = shape
    losses[name], state = step_losses(config, devs, batches)
    if name == 'eight':
      kernel = state[0]['layers'][1]['mlp']['experts']['gate_proj'][...]
      assert kernel.sharding.spec[0] == 'data'  # experts are split across devices
  np.testing.assert_allclose(losses['one'], losses['eight'], rtol=2e-5)


@pytest.mark.parametrize('field,value,match', [
    ('mlp', 'sparse', "model.mlp must be 'dense' or 'moe'"),
    ('moe.num_experts_per_tok', 5, 'num_experts_per_tok .5. must be <='),
    ('moe.first_k_dense', 3, 'first_k_dense .3. must be <= model.n_layers'),
    ('mtp.block_mlp', 'big', "model.mtp.block_mlp must be"),
    ('moe.n_group', 3, r'n_routed_experts \(4\) must be divisible by model.moe.n_group \(3\)'),
    ('moe.topk_group', 2, r'topk_group \(2\) must be <= model.moe.n_group \(1\)'),
    ('moe.exchange', 'a2a', "model.moe.exchange must be 'all_to_all' or 'all_gather'"),
    ('moe.capacity_factor', -1.0, 'model.moe.capacity_factor must be a number >= 0'),
])
def test_bad_moe_fields(field, value, match):
  c = dsv3_model_config(1)
  set_field(c, field, value)
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)


def test_experts_must_divide_the_expert_axis():
  c = dsv3_model_config(1, n_routed_experts=3, num_experts_per_tok=2)
  c.mesh.shape = (2, 2, 2)
  with pytest.raises(config_lib.ConfigError, match='n_routed_experts .3. must be divisible'):
    config_lib.validate(c, 8)


def test_flops_count_mla_and_active_experts_only():
  """dsv3_model_config(1): d 32, 4 heads, q_lora 12, kv_lora 8, dn 6, dr 4, dv 5; E 4, K 2,
  1 shared, expert width 16; layer 0 dense (mlp 64), layer 1 and the MTP block MoE; T 16."""
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(dsv3_model_config(1)))
  mla_proj = (2 * 32 * 12 + 2 * 12 * 4 * 10) + (2 * 32 * 12 + 2 * 8 * 4 * 11) + 2 * 4 * 5 * 32
  attn = 2 * 4 * 10 * 8.5 + 2 * 4 * 5 * 8.5  # scores over dn + dr, values over dv
  dense = 3 * 2 * 32 * 64
  moe_active = 2 * 32 * 4 + 3 * 2 * 32 * 16 * (2 + 1)  # router + 2 routed + 1 shared
  got = flops.flops_per_token(args, seq_len=16)
  assert got.trunk_matmul == 2 * mla_proj + dense + moe_active
  assert got.trunk_attention == 2 * attn
  assert got.mtp_block == mla_proj + moe_active + attn


def test_mtp_block_overrides_on_a_dense_trunk():
  """GQA + dense trunk, MLA + MoE MTP block (model.mtp.block_*): layout and numpy forward."""
  c = dsv3_model_config(1, attention='gqa', mlp='dense')
  c.model.mtp.block_attention, c.model.mtp.block_mlp = 'mla', 'moe'
  config_lib.validate(c)
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(c)), rngs=nnx.Rngs(0))
  params = params_with_routing_bias(model)
  assert all('k_proj' in p['self_attn'] and 'gate_proj' in p['mlp']
             for p in params['layers'].values())
  blk = params['mtp'][0]['block']
  assert 'kv_b_proj' in blk['self_attn'] and 'experts' in blk['mlp']
  hs = nnx.jit(lambda m: m(jnp.asarray(TOKENS[:1]), jnp.asarray(POS[:1]),
                           jnp.asarray(SEG[:1])))(model)
  want = ref.forward(params, TOKENS[0], POS[0], SEG[0], 1, moe=(TOP_K, SCALING))
  for k in range(2):
    np.testing.assert_allclose(np.asarray(hs[k][0]), want[k], rtol=2e-4, atol=2e-4)


def test_fp8_block_dequantisation():
  """A weight quantised to e4m3 in 128 x 128 blocks (partial edge blocks) comes back within
  e4m3's rounding, and each block is exactly its fp8 values times its own scale."""
  rng = np.random.default_rng(0)
  w = rng.normal(size=(200, 300)).astype(np.float32) * np.linspace(0.1, 3, 300)
  scale = np.zeros((2, 3), np.float32)
  q = np.zeros(w.shape, jnp.float8_e4m3fn)
  for p in range(2):
    for c in range(3):
      blk = w[p * 128:(p + 1) * 128, c * 128:(c + 1) * 128]
      scale[p, c] = np.abs(blk).max() / 448.0  # e4m3's largest finite value
      q[p * 128:(p + 1) * 128, c * 128:(c + 1) * 128] = (blk / scale[p, c]).astype(q.dtype)
  got = fp8.dequantize(q, scale)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got[130:, 260:], q[130:, 260:].astype(np.float32) * scale[1, 2])
  np.testing.assert_allclose(got, w, rtol=2 ** -3, atol=float(scale.max()) * 2 ** -6)
  with pytest.raises(ValueError, match='expected \\(2, 3\\)'):
    fp8.dequantize(q, scale[:, :2])


# -- the expert-parallel exchange (mtp_jax/model/moe_exchange.py) -------------------------------
def _who_sends_what(idx_XsxBTxEk, n_dev, e_local, rows, block):
  """numpy: per device, the rows it sends to each device (its rows sorted by expert, each
  device's slice padded to whole blocks in its send buffer): the slice's offset, the rows
  moved (its kept rows, padded to whole blocks), where they land in the receiver's buffer
  (filled from the senders p, p + 1, ... for receiver p, each slice on a block; at most R
  real rows kept) and the rows dropped."""
  q_n = idx_XsxBTxEk.shape[0]
  up = lambda a: -(-a // block) * block  # noqa: E731
  sent = np.zeros((q_n, n_dev), int)
  for q in range(q_n):
    for e in idx_XsxBTxEk[q].reshape(-1):
      sent[q, e // e_local] += 1
  in_off, moved, out_off, kept = (np.zeros((q_n, n_dev), int) for _ in range(4))
  for q in range(q_n):
    in_off[q] = np.concatenate([[0], np.cumsum(up(sent[q]))[:-1]])
  for p in range(n_dev):
    real, slots = 0, 0
    for q in [(p + j) % q_n for j in range(q_n)]:  # receiver p fills from sender p on
      kept[q, p] = max(0, min(sent[q, p], rows - real))
      out_off[q, p], moved[q, p] = slots, up(kept[q, p])
      real, slots = real + sent[q, p], slots + moved[q, p]
  return in_off, moved, out_off, kept, sent - kept


def _split(mesh, a):
  return jax.device_put(jnp.asarray(a), jax.sharding.NamedSharding(mesh, P('x')))


@pytest.mark.parametrize('block', [1, 16])
@pytest.mark.parametrize('rows', [None, 10])
def test_exchange_offsets_and_sizes_match_numpy(devices, rows, block):
  """Each of 8 devices computes, from its own expert counts and the all-gathered ones, the
  offsets and sizes of ragged_all_to_all: they equal the numpy account of who sends what
  to whom (dropless buffer, and a 10-row buffer that cuts slices), row by row and in
  blocks of 16 rows; every slice fits the padded buffers."""
  n_dev, e_local, n, k = 8, 2, 6, 2
  rng = np.random.default_rng(5)
  idx = np.stack([np.stack([rng.choice(n_dev * e_local, k, replace=False) for _ in range(n)])
                  for _ in range(n_dev)])  # [Xs, BT, Ek]
  r = rows or moe_exchange.buffer_rows(n, k, n_dev, e_local, 0.0)
  assert rows or r == n_dev * n * k  # min(K, E / P) = 2 rows per token at most
  mesh = jax.make_mesh((n_dev,), ('x',), devices=devices)
  names = ('input_offsets', 'send_sizes', 'output_offsets', 'recv_sizes', 'kept', 'dropped')

  def local(idx_BTxEk):
    counts = jnp.bincount(idx_BTxEk.reshape(-1), length=n_dev * e_local).reshape(n_dev, e_local)
    all_counts = jax.lax.all_gather(counts, 'x')
    p = moe_exchange.plan(counts, all_counts, jax.lax.axis_index('x'), r, block)
    return tuple(p[name][None] for name in names)

  run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P('x'), out_specs=P('x')))
  in_off, send, out_off, recv, kept, dropped = (np.asarray(a) for a in run(
      _split(mesh, idx.reshape(n_dev * n, k))))
  ref_in, ref_moved, ref_out, ref_kept, ref_dropped = _who_sends_what(idx, n_dev, e_local, r,
                                                                      block)
  np.testing.assert_array_equal(in_off, ref_in)
  np.testing.assert_array_equal(send, ref_moved)
  np.testing.assert_array_equal(out_off, ref_out)
  np.testing.assert_array_equal(recv, ref_moved.T)  # what q sends p is what p receives from q
  np.testing.assert_array_equal(kept, ref_kept)
  np.testing.assert_array_equal(dropped.reshape(-1), ref_dropped.sum(1))
  assert (ref_dropped.sum() > 0) == (rows is not None)
  if rows:  # every receiver overflows here, and each cuts a different sender's rows
    assert np.count_nonzero(ref_dropped.sum(1)) > n_dev // 2
  assert (in_off % block == 0).all() and (out_off % block == 0).all()
  assert (in_off + send <= moe_exchange.padded_rows(n * k, n_dev, block)).all()
  assert (out_off + send <= moe_exchange.padded_rows(r, n_dev, block)).all()


def test_exchange_emulation_moves_the_rows_numpy_says(devices):
  """The CPU form of ragged_all_to_all writes sender q's rows [in_off, in_off + size) at
  out_off of receiver p and leaves the rest of p's output as it was (here: -1); slices
  with a gap of one row between them, so that offsets are not sizes' sums."""
  n_dev, m, r = 8, 24, 24
  rng = np.random.default_rng(7)
  send = rng.integers(0, 3, size=(n_dev, n_dev))  # [q, p]
  in_off = np.cumsum(send + 1, axis=1) - send - 1
  out_off = np.cumsum(send + 1, axis=0) - send - 1
  data = rng.normal(size=(n_dev, m, 3)).astype(np.float32)
  mesh = jax.make_mesh((n_dev,), ('x',), devices=devices)

  def local(x, io, ss, oo, rs):
    return moe_exchange.ragged_exchange(x[0], -jnp.ones((r, 3)), io[0], ss[0], oo[0], rs[0],
                                        ('x',), 'emulate')[None]

  got = np.asarray(jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P('x'), out_specs=P('x')))(
      *(_split(mesh, a) for a in (data, in_off, send, out_off, send.T.copy()))))
  want = -np.ones((n_dev, r, 3), np.float32)
  for q in range(n_dev):
    for p in range(n_dev):
      want[p, out_off[q, p]:out_off[q, p] + send[q, p]] = data[q, in_off[q, p]:
                                                                in_off[q, p] + send[q, p]]
  np.testing.assert_array_equal(got, want)


def _moe_layer(**kw):
  config = dsv3_model_config(1, n_routed_experts=8, num_experts_per_tok=2)
  for key, value in kw.items():
    config.model.moe[key] = value
  model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)),
                   rngs=nnx.Rngs(0))
  return config, model, model.layers[1].mlp


@pytest.mark.parametrize('exchange', ['all_to_all', 'all_gather'])
def test_routing_statistics_and_exchanges_agree_with_one_device(devices, exchange):
  """Under either exchange on (2, 2, 2) the layer's output, expert load, balance term and
  the bias range update_bias makes from them read as on one device."""
  config, model, layer = _moe_layer(exchange=exchange)
  params_with_routing_bias(model, scale=0.3)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6, 32)).astype(np.float32))

  def stats(m, x):
    y = m(x)
    s = moe.collect(m)
    return y, s, moe.update_bias(m, s['moe_load'], 1e-3)

  y0, s0, b0 = nnx.jit(stats)(layer, x)
  config.mesh.shape = (2, 2, 2)
  _, model1, layer1 = _moe_layer(exchange=exchange)
  params_with_routing_bias(model1, scale=0.3)
  with sharding.use_mesh(sharding.make_mesh(config, devices), sharding.rules_of(config)):
    y1, s1, b1 = nnx.jit(stats)(layer1, x)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)
  for a, b in [(s0['moe_load'], s1['moe_load']), (s0['moe_balance'], s1['moe_balance']),
               (b0['moe_bias_min'], b1['moe_bias_min']), (b0['moe_bias_max'], b1['moe_bias_max'])]:
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6)
  assert 'moe_dropped' not in s1  # dropless: nothing to count


def test_capacity_factor_counts_the_dropped_rows(devices):
  """A receive buffer of c N K rows: the rows past it (per receiver: all rows sent to it
  minus R) are dropped, counted per layer, and logged; the kept rows' outputs stay exact:
  with c large enough to drop nothing the output is the dropless one."""
  config, model, layer = _moe_layer(capacity_factor=0.5)
  params_with_routing_bias(model, scale=2.0)  # uneven routing: some devices overflow
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 6, 32)).astype(np.float32))
  config.mesh.shape = (8, 1, 1)

  def run(m, x):
    y = m(x)
    return y, moe.collect(m)

  with sharding.use_mesh(sharding.make_mesh(config, devices), sharding.rules_of(config)):
    _, s = nnx.jit(run)(layer, x)
  n, k = 6, 2  # tokens per device (one sequence of 6), experts per token
  rows = moe_exchange.buffer_rows(n, k, 8, 1, 0.5)
  assert rows == 8
  # device p holds expert p: everything routed to it past R rows is dropped
  want = np.maximum(np.asarray(s['moe_load'][0]) - rows, 0).sum()
  assert want > 0
  assert float(s['moe_dropped'][0]) == want
  assert moe.log_metrics({**s, 'moe_bias_min': np.zeros(1), 'moe_bias_max': np.zeros(1)})[
      'train/moe_dropped_rows_l0'] == want


def test_remat_block_saves_the_expert_products():
  """Under remat='block' the grouped products' outputs (named moe.EXPERT_SAVED_NAME) are
  saved: the gradient's program holds as many grouped products as with nothing
  rematerialised, and fewer than the same policy without that name, which reruns them."""
  from mtp_jax.model.blocks import remat_policy
  experts = build(n_routed_experts=8).layers[1].mlp.experts
  xs = jnp.ones((16, 32))
  sizes = jnp.array([3, 0, 5, 1, 7, 0, 0, 0], jnp.int32)
  without_name = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

  def products(policy):
    f = jax.checkpoint(lambda ws, xs: jnp.sum(moe.grouped_products(xs, sizes, ws, 'ragged')),
                       policy=policy)
    return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(_ws(experts), xs)).count(
        'ragged_dot_general[')

  block = products(remat_policy('block'))
  assert block == products(jax.checkpoint_policies.everything_saveable)
  assert block < products(without_name)


def test_token_rows_gradient_reads_only_the_slots_sent():
  """moe_exchange.token_rows: forward, each slot holds its token's row; backward, a token's
  gradient is the sum of its sent slots' cotangents, with NaN in the padding slots and in
  a dropped row's slot (what an exchange leaves there on TPU) never read."""
  rng = np.random.default_rng(3)
  n, k, d, s = 5, 2, 4, 16
  x = jnp.asarray(rng.normal(size=(n, d)).astype(np.float32))
  slots = rng.permutation(s)[:n * k].reshape(n, k)  # the other 6 slots: padding
  token_S = np.zeros(s, np.int32)
  token_S[slots.reshape(-1)] = np.repeat(np.arange(n), k)
  sent = np.ones((n, k), bool)
  sent[2, 1] = False  # dropped by the exchange
  ct = rng.normal(size=(s, d)).astype(np.float32)
  ct[np.setdiff1d(np.arange(s), slots.reshape(-1))] = np.nan
  ct[slots[2, 1]] = np.nan
  fwd = lambda x: moe_exchange.token_rows(x, jnp.asarray(token_S), jnp.asarray(slots),  # noqa: E731
                                          jnp.asarray(sent), jnp.bfloat16)
  out, vjp = jax.vjp(fwd, x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32)[slots[:, 1]],
                                np.asarray(x.astype(jnp.bfloat16), np.float32))
  (gx,) = vjp(jnp.asarray(ct, jnp.bfloat16))
  want = sum(np.where(sent[:, j:j + 1], np.asarray(jnp.asarray(ct, jnp.bfloat16), np.float32)
                      [slots[:, j]], 0.0) for j in range(k))
  np.testing.assert_allclose(np.asarray(gx), want, rtol=1e-6)
