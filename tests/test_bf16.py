"""bfloat16 compute on CPU: model/matmul.py's one product form, its gradients against float32
autodiff, the train step's dot forms in the compiled program, MFU per compute dtype and
model.dtype = 'auto'."""
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from mtp_jax.model import matmul
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train import train_and_evaluate
from mtp_jax.train.aot.hlo_read import cpu_dot_forms

F32, BF16 = jnp.float32, jnp.bfloat16

# (spec, a shape, b shape, the function): every product form the model routes through
# matmul.py: a projection, q k^T and p v of the attention cores, the loss head over stacked
# depths, the MoE blocks' grouped product, and a gradient-style a^T b.
FORMS = [
    ('mk,kn->mn', (48, 32), (32, 40), 'einsum'),
    ('bnqh,bnsh->bnqs', (2, 3, 16, 8), (2, 3, 24, 8), 'einsum'),
    ('bnqs,bnsh->bnqh', (2, 3, 16, 24), (2, 3, 24, 8), 'einsum'),
    ('kbtd,dv->kbtv', (2, 3, 8, 16), (16, 40), 'einsum'),
    ('jbi,jio->jbo', (3, 8, 16), (3, 16, 24), 'einsum'),
    ('bnqs,bnqh->bnsh', (2, 3, 16, 24), (2, 3, 16, 8), 'einsum_lhs_t'),
]


def _loss(fn, spec, dtype):
  def f(a, b):  # a nonlinear read-out, so the cotangent dy is not uniform
    return jnp.sum(jnp.sin(getattr(matmul, fn)(spec, a, b, dtype, F32)))
  return f


def _rel(x, ref):
  return float(jnp.max(jnp.abs(x.astype(F32) - ref)) / jnp.max(jnp.abs(ref)))


@pytest.mark.parametrize('spec,sa,sb,fn', FORMS)
def test_bf16_gradients_match_float32_autodiff(spec, sa, sb, fn):
  """The custom VJP's bf16 gradients (bf16 operands, f32 accumulation) are float32
  autodiff's within bf16 rounding, and no worse than bf16 autodiff of the plain einsum;
  they leave in the operands' own dtype (float32 master weights)."""
  ka, kb = jax.random.split(jax.random.key(0))
  a, b = jax.random.normal(ka, sa, F32), jax.random.normal(kb, sb, F32)
  ref = jax.grad(_loss(fn, spec, F32), (0, 1))(a, b)
  got = jax.jit(jax.grad(_loss(fn, spec, BF16), (0, 1)))(a, b)

  def plain(a, b):
    return jnp.sum(jnp.sin(jnp.einsum(spec, a.astype(BF16), b.astype(BF16),
                                      preferred_element_type=F32)))
  base = jax.jit(jax.grad(plain, (0, 1)))(a, b)
  for g, r, p in zip(got, ref, base):
    assert g.dtype == F32 and g.shape == r.shape
    assert _rel(g, r) < 3e-2, (spec, _rel(g, r))
    assert _rel(g, r) < 2 * _rel(p, r) + 1e-2, (spec, _rel(g, r), _rel(p, r))
  # the forward too, within bf16 rounding of the inputs
  y = getattr(matmul, fn)(spec, a, b, BF16, F32)
  assert _rel(y, getattr(matmul, fn)(spec, a, b, F32, F32)) < 2e-2


def test_float32_and_accelerators_keep_the_plain_dot(monkeypatch):
  """float32 einsum: the HLO of jnp.einsum itself; float32 matmul on CPU: the row-major
  custom VJP, with jnp.dot's values and float32 autodiff's gradients; off CPU: no custom
  VJP in the program, either dtype."""
  x, w = jnp.ones((16, 8), F32), jnp.ones((8, 4), F32)
  spec = 'bnqh,bnsh->bnqs'
  q = jnp.ones((1, 2, 8, 4), F32)
  ours = jax.jit(lambda a, b: matmul.einsum(spec, a, b, F32)).lower(q, q).as_text()
  plain = jax.jit(lambda a, b: jnp.einsum(spec, a, b)).lower(q, q).as_text()
  assert ours.replace('<lambda>', '') == plain.replace('<lambda>', '')
  for dt in (BF16, F32):
    grad = jax.grad(lambda x, w, dt=dt: jnp.sum(matmul.matmul(x, w, dt)), (0, 1))
    assert 'optimization_barrier' in str(jax.make_jaxpr(grad)(x, w))  # _cpu_dot's backward
  ka, kb = jax.random.split(jax.random.key(3))
  xr, wr = jax.random.normal(ka, (16, 8), F32), jax.random.normal(kb, (8, 4), F32)
  assert np.allclose(matmul.matmul(xr, wr, F32), jnp.dot(xr, wr), rtol=1e-6, atol=1e-6)
  f = lambda fn: jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), (0, 1))(xr, wr)  # noqa: E731
  for g, r in zip(f(lambda x, w: matmul.matmul(x, w, F32)), f(jnp.dot)):
    assert g.dtype == F32 and np.allclose(g, r, rtol=1e-5, atol=1e-5)
  monkeypatch.setattr(jax, 'default_backend', lambda: 'tpu')
  assert not matmul.bf16_kernels(BF16) and not matmul.row_major_f32(F32)
  for dt in (BF16, F32):
    grad = jax.grad(lambda x, w, dt=dt: jnp.sum(matmul.matmul(x, w, dt)), (0, 1))  # anew
    assert 'optimization_barrier' not in str(jax.make_jaxpr(grad)(x, w))
  with pytest.raises(ValueError, match='not a batched matmul'):
    matmul.parse_spec('bij,bjk->bki')




def test_bf16_train_step_runs_its_matmuls_on_the_bf16_kernel_form():
  """The compiled bf16 train step (projections, MTP eh_proj, attention core, loss head,
  forward and backward): >= 90 % of its matmul FLOPs are bf16 x bf16 -> f32 dots with a
  row-major left operand, the rest f32 (the norms' matrix-vector products); and the step
  runs (XLA:CPU's generic dot has no bf16 x bf16 -> f32 kernel)."""
  compiled, state, batch = helpers.compiled_tiny_step('bfloat16', depth=2)
  forms = cpu_dot_forms(compiled.as_text())
  total = sum(forms.values())
  assert forms.get('bf16 kernels', 0) >= 0.9 * total, forms
  assert set(forms) <= {'bf16 kernels', 'f32 x f32 -> f32'}, forms
  _, metrics = compiled(state, batch)
  assert np.isfinite(float(metrics['loss']))


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
  monkeypatch.setenv(peak_lib.CACHE_DIR_ENV, str(tmp_path / 'peak_cache'))
  for env in (peak_lib.PEAK_ENV, peak_lib.BF16_PEAK_ENV, peak_lib.AUTO_ENV):
    monkeypatch.delenv(env, raising=False)
  return tmp_path / 'peak_cache'


def _poison(cache_dir, peaks):
  os.makedirs(cache_dir, exist_ok=True)
  record = lambda f: {'flops': f, 'date': '2026-01-01T00:00:00', 'load_average': [0.1, 0.1]}  # noqa: E731
  (cache_dir / 'cpu_peak_flops.json').write_text(json.dumps(
      {peak_lib.machine_key(dt): record(f) for dt, f in peaks.items()}))


def _cached(cache_dir, dtype):
  return json.loads((cache_dir / 'cpu_peak_flops.json').read_text())[peak_lib.machine_key(dtype)]


def test_peaks_are_per_dtype_and_a_run_raises_only_its_own(peak_cache, monkeypatch):
  _poison(peak_cache, {F32: 100e9, BF16: 400e9})
  monkeypatch.setattr(peak_lib, 'matmul_probe', lambda *a, **k: 1e9)
  f32, bf16 = peak_lib.job_peak(F32), peak_lib.job_peak(BF16)
  assert (f32.flops, bf16.flops) == (100e9, 400e9)
  assert peak_lib.job_peak(jnp.float16).flops == 100e9  # XLA:CPU runs f16 dots in f32
  assert 'bfloat16 matmul probe' in bf16.line()
  assert bf16.as_metrics()['perf/peak_dtype'] == 'bfloat16'
  assert bf16.check(200e9) == 0.5
  assert bf16.check(800e9) == 1.0  # raises the bf16 cache only
  assert _cached(peak_cache, BF16)['flops'] == 800e9
  assert _cached(peak_cache, F32)['flops'] == 100e9
  assert f32.check(300e9) == 1.0
  assert _cached(peak_cache, F32)['flops'] == 300e9 and _cached(peak_cache, BF16)['flops'] == 800e9
  monkeypatch.setenv(peak_lib.BF16_PEAK_ENV, '1e12')
  assert peak_lib.job_peak(BF16).flops == 1e12 and peak_lib.job_peak(F32).flops == 300e9


def test_a_bf16_runs_peak_flops_is_the_bf16_peak(devices, peak_cache, tmp_path, monkeypatch):
  """A bf16 training run divides by the bf16 peak, raises it (both caches start far below
  what it achieves) and leaves the cached f32 peak as it was."""
  _poison(peak_cache, {F32: 1e3, BF16: 2e3})
  monkeypatch.setattr(peak_lib, 'matmul_probe', lambda *a, **k: 1.0)
  config = helpers.jsonl_config(helpers.write_jsonl(tmp_path / 'docs.jsonl'), steps=4)
  config.model.dtype = 'bfloat16'
  train_and_evaluate(config, str(tmp_path / 'run'), devices=devices[:1])
  rows = [json.loads(x) for x in
          pathlib.Path(tmp_path / 'run', 'metrics.jsonl').read_text().splitlines()]
  perf = [r for r in rows if 'perf/peak_flops' in r]
  assert perf and all(r['perf/peak_dtype'] == 'bfloat16' for r in perf)
  assert _cached(peak_cache, BF16)['flops'] == max(r['perf/peak_flops'] for r in perf) > 2e3
  assert _cached(peak_cache, F32)['flops'] == 1e3


def test_auto_dtype_follows_the_cached_bf16_speedup(peak_cache, monkeypatch):
  ratio_file = pathlib.Path(peak_lib.ratio_file())
  key = peak_lib.machine_key(BF16).rsplit(' | ', 1)[0]
  for ratio, want in ((5.4, BF16), (2.0, BF16), (1.3, F32), (0.4, F32)):
    ratio_file.parent.mkdir(parents=True, exist_ok=True)
    ratio_file.write_text(json.dumps({key: {'ratio': ratio}}))
    assert peak_lib.compute_dtype('auto', 'cpu') == want
  assert peak_lib.compute_dtype('auto', 'tpu') == F32
  assert peak_lib.compute_dtype('bfloat16', 'cpu') == BF16
  monkeypatch.setenv(peak_lib.AUTO_ENV, 'bfloat16')
  assert peak_lib.compute_dtype('auto', 'cpu') == BF16
  # no cache: a quick interleaved probe of both dtypes, then cached
  monkeypatch.delenv(peak_lib.AUTO_ENV)
  ratio_file.unlink()
  monkeypatch.setattr(peak_lib, 'matmul_probe',
                      lambda n, dtype, reps: 300e9 if jnp.dtype(dtype) == BF16 else 100e9)
  assert peak_lib.compute_dtype('auto', 'cpu') == BF16
  assert json.loads(ratio_file.read_text())[key]['ratio'] == 3.0


def test_auto_is_per_job(peak_cache, monkeypatch):
  """'auto' on a host where training picks bfloat16: decoding and Hugging Face imports
  still resolve float32; a run's resolution keeps the request beside it, so a saved config
  re-resolves 'auto' for the next job instead of inheriting the training's bfloat16."""
  monkeypatch.setenv(peak_lib.AUTO_ENV, 'bfloat16')
  assert peak_lib.compute_dtype('auto', 'cpu', 'train') == BF16
  for job in peak_lib.EXACT_JOBS:
    assert peak_lib.compute_dtype('auto', 'cpu', job) == F32
    assert peak_lib.compute_dtype('bfloat16', 'cpu', job) == BF16  # an explicit choice stays
  with pytest.raises(ValueError, match='unknown job'):
    peak_lib.compute_dtype('auto', 'cpu', 'serve')
  c = helpers.tiny_model_config(depth=1)
  line = peak_lib.resolve_model_dtype(c, 'train')
  assert (c.model.dtype, c.model.dtype_requested) == ('bfloat16', 'auto')
  assert line.startswith('Compute dtype: bfloat16') and 'auto' in line
  saved = type(c)(json.loads(c.to_json_best_effort()))  # what config.json holds
  peak_lib.resolve_model_dtype(saved, 'decode')
  assert (saved.model.dtype, saved.model.dtype_requested) == ('float32', 'auto')
  saved.model.dtype = 'float32'  # a rerun of the saved config with an override trains so
  peak_lib.resolve_model_dtype(saved, 'train')
  assert (saved.model.dtype, saved.model.dtype_requested) == ('float32', 'float32')
  explicit = helpers.tiny_model_config(depth=1)
  explicit.model.dtype = 'bfloat16'
  peak_lib.resolve_model_dtype(explicit, 'interop')
  assert explicit.model.dtype == 'bfloat16'


def test_bf16_stacked_head_gradient_stays_on_each_device():
  """The loss head's product over stacked depths [K, B, T, D] x [D, V] on a 2-device data
  mesh: its bf16 weight gradient runs on each device's own rows (one all-reduce of
  [D, V] partial sums), no all-gather of the activations, and equals float32 autodiff's."""
  mesh = jax.make_mesh((2,), ('data',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, 'data'))
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.device_put(jax.random.normal(ka, (3, 4, 16, 32), F32), rows)
  b = jax.device_put(jax.random.normal(kb, (32, 24), F32),
                     jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  grad = jax.jit(jax.grad(_loss('einsum', 'kbtd,dv->kbtv', BF16), (0, 1)))
  text = grad.lower(a, b).compile().as_text()
  assert 'all-gather' not in text and 'all-reduce' in text
  got, ref = grad(a, b), jax.grad(_loss('einsum', 'kbtd,dv->kbtv', F32), (0, 1))(a, b)
  for g, r in zip(got, ref):
    assert _rel(g, r) < 3e-2


def test_bf16_step_makes_one_bf16_copy_of_each_weight():
  """Every float32 parameter of the compiled bf16 step feeds at most one bf16-producing
  op (its one cast, reused by the forward and both gradient products), and the matrices
  feed one each: no weight is cast again per use."""
  from mtp_jax.train.aot import hlo_read
  compiled, _, _ = helpers.compiled_tiny_step('bfloat16', depth=2)
  comps, _, entry = hlo_read.read_computations(compiled.as_text())
  body = comps[entry]
  params = {n: t for n, t, op, _, _ in body if op == 'parameter' and t.startswith('f32[')}
  casts = {n: 0 for n in params}
  for _, typ, _, rest, _ in body:
    if typ.startswith('bf16'):
      for o in set(hlo_read.operands(rest)):
        if o in casts:
          casts[o] += 1
  assert max(casts.values()) <= 1, {n: c for n, c in casts.items() if c > 1}
  matrices = [n for n, t in params.items() if ',' in t.split(']')[0]]
  assert sum(casts[n] for n in matrices) >= 10, casts


def test_float32_step_runs_its_projection_gradients_row_major():
  """The compiled float32 train step: the projections' weight gradients x^T dy are dots
  with a row-major left operand (model/matmul.py's float32 form on CPU), so what is left
  with a transposed left operand (the attention cores' and loss head's einsums) is a
  small share of the matmul FLOPs; the step runs."""
  compiled, state, batch = helpers.compiled_tiny_step('float32', depth=2)
  forms = cpu_dot_forms(compiled.as_text())
  total = sum(forms.values())
  assert forms.get('f32 x f32 -> f32 (lhs transposed)', 0) < 0.15 * total, forms
  _, metrics = compiled(state, batch)
  assert np.isfinite(float(metrics['loss']))
