"""Scale: every config builds abstractly, FLOPs per token, remat / scan variants, MFU."""
import glob
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (
  REPO,
  load_config,
  loss_batch,
  loss_grads,
  step_losses,
  synthetic_batches,
  tiny_model_config,
)
from mtp_jax import config_files, config_lib
from mtp_jax.data import tokenizers
from mtp_jax.model import ModelArgs, MTPModel, count_params
from mtp_jax.runtime import distributed, sharding, tpu_flags
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train import flops
from mtp_jax.train import loss as loss_lib
from mtp_jax.train.steps import loss_args

CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0]
                 for p in glob.glob(os.path.join(REPO, 'configs', '*.py'))
                 if not os.path.basename(p).startswith('_'))  # _*.py: shared parts


def _config_devices(name):
  """The device count a config's mesh is written for (module constant DEVICES), or 8."""
  module = config_files.load_module(os.path.join(REPO, 'configs', f'{name}.py'))
  return getattr(module, 'DEVICES', 8)


@pytest.mark.parametrize('name', CONFIGS)
def test_config_validates_and_builds_abstractly(name):
  config = load_config(name)
  num_devices = _config_devices(name)
  config_lib.validate(config, num_devices)
  if not config.model.vocab_size:  # sized by the tokenizer (byte level here)
    assert config.data.tokenizer == 'byte'
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(config))
  abstract = nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0)))
  counts = count_params(abstract)
  per_token = flops.flops_per_token(args, config.data.seq_len)
  print(f'\n{name}: {counts["total"] / 1e6:.1f}M params ({counts["mtp"] / 1e6:.1f}M in '
        f'{args.mtp_depth} MTP depths), {per_token.train / 1e9:.3f} GFLOP per training token, '
        f'mesh {config_lib.resolved_mesh_axes(config.mesh, num_devices)} on '
        f'{num_devices} devices')
  assert counts['total'] > 0 and per_token.train > 0

  # Every parameter divides evenly over the mesh axes its logical names map to.
  sizes = config_lib.resolved_mesh_axes(config.mesh, num_devices)
  mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), config_lib.MESH_AXES)
  with nnx.logical_axis_rules(sharding.rules_of(config)):
    shardings = nnx.get_named_sharding(nnx.state(abstract, nnx.Param), mesh)
  for path, (leaf, sh) in zip(
      [p for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(abstract, nnx.Param))],
      zip(jax.tree.leaves(nnx.state(abstract, nnx.Param)), jax.tree.leaves(shardings))):
    for dim, axes in zip(leaf.shape, tuple(sh.spec) + (None,) * leaf.ndim):
      axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
      ways = math.prod(sizes[a] for a in axes)
      assert dim % ways == 0, f'{name}: {jax.tree_util.keystr(path)} dim {dim} over {axes}'


def test_pod_configs_are_the_advertised_sizes():
  for name, low, high in [('gpu_350m', 300e6, 400e6), ('tpu_pod_1b', 0.9e9, 1.2e9)]:
    args = ModelArgs.from_config(tokenizers.resolve_vocab_size(load_config(name)))
    total = count_params(nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0))))['total']
    assert low < total < high, (name, total)


def test_flops_match_a_hand_count():
  """tiny_model_config(2): d=32, L=2, 4 query / 2 kv heads of 8, mlp 64, V=64, T=16, M=2."""
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(tiny_model_config(2)))
  q, kv, o = 2 * 32 * 32, 2 * 2 * 32 * 16, 2 * 32 * 32  # 2 FLOPs per multiply-add
  mlp = 3 * 2 * 32 * 64
  attn = 2 * 2 * 32 * 8.5  # scores + values over 32 query dims, (16 + 1) / 2 keys on average
  block = q + kv + o + mlp + attn  # 19520
  eh_proj = 2 * 64 * 32
  vocab = 2 * 32 * 64
  got = flops.flops_per_token(args, seq_len=16)
  assert got.trunk_matmul == 2 * (q + kv + o + mlp)
  assert got.trunk_attention == 2 * attn
  assert got.mtp_eh_proj == 2 * eh_proj
  assert got.mtp_block == 2 * block
  assert got.vocab == 3 * vocab  # the main head and both depths
  assert got.forward == 2 * block + 2 * (eh_proj + block) + 3 * vocab == 98560
  assert got.train == 3 * 98560
  full = flops.flops_per_token(args, seq_len=16, causal=False)
  assert full.trunk_attention == 2 * (2 * 2 * 32 * 16)
  parallel = flops.flops_per_token(ModelArgs.from_config(
      tokenizers.resolve_vocab_size(tiny_model_config(2, 'parallel'))), 16)
  assert parallel.mtp_eh_proj == 0 and parallel.mtp_block == 2 * block


def test_peak_table_and_cpu_probe():
  assert peak_lib.table_peak('TPU v5', jnp.bfloat16) == 459e12
  assert peak_lib.table_peak('TPU v5 lite', jnp.bfloat16) == 197e12  # longest prefix wins
  assert peak_lib.table_peak('NVIDIA H100 80GB HBM3', jnp.float32) == 494e12
  assert peak_lib.table_peak('some new chip', jnp.bfloat16) is None
  peak, source = peak_lib.peak_flops(jnp.float32, jax.devices())
  assert peak > 1e9 and 'probe' in source  # 8 fake CPU devices share one process's cores


def test_distributed_initialize_arguments(monkeypatch):
  for var in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID',
              'TPU_WORKER_HOSTNAMES', 'SLURM_NTASKS', 'SLURM_STEP_NUM_TASKS',
              'OMPI_COMM_WORLD_SIZE'):
    monkeypatch.delenv(var, raising=False)
  assert distributed.initialize('off') is False
  assert distributed.initialize('auto') is False  # a plain single-process run
  with pytest.raises(ValueError, match='process_id'):
    distributed.initialize('auto', coordinator_address='127.0.0.1:1', num_processes=2)
  with pytest.raises(ValueError, match='mode'):
    distributed.initialize('sometimes')
  monkeypatch.setenv('SLURM_NTASKS', '4')
  assert distributed.managed_cluster() == 'slurm'
  monkeypatch.setenv('SLURM_NTASKS', '1')
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'w0,w1,w2,w3')
  assert distributed.managed_cluster() == 'cloud_tpu'


VARIANTS = [('sequential', 'none', False), ('sequential', 'block', False),
            ('sequential', 'full', True), ('sequential', 'none', True),
            ('parallel', 'none', False), ('parallel', 'full', True)]


def test_remat_and_scan_give_the_same_loss_and_gradients():
  """Scan covers the trunk layers and the MTP depths (sequential chain and parallel heads)."""
  b = loss_batch(0)
  results, trees = {}, {}
  for kind, remat, scan in VARIANTS:
    config = tiny_model_config(2, kind, remat=remat, scan_layers=scan)
    config.model.n_layers = 3
    model = MTPModel(ModelArgs.from_config(tokenizers.resolve_vocab_size(config)), rngs=nnx.Rngs(0))
    trees.setdefault(kind, set()).add(
        str(jax.tree.structure(nnx.to_pure_dict(nnx.state(model, nnx.Param)))))
    weights = loss_lib.depth_weights(loss_args(config), 0)
    results[(kind, remat, scan)] = loss_grads(model, b, weights)
  assert all(len(t) == 1 for t in trees.values())  # checkpoints do not depend on remat / scan
  for key, ((l, s), g) in results.items():
    (l0, s0), g0 = results[(key[0], 'none', False)]
    np.testing.assert_allclose(float(l), float(l0), rtol=1e-6, err_msg=str(key))
    np.testing.assert_array_equal(np.asarray(s['correct']), np.asarray(s0['correct']))
    np.testing.assert_array_equal(np.asarray(s['agree']), np.asarray(s0['agree']))
    for a, b_ in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-7,
                                 err_msg=str(key))


def test_scanned_rematerialised_step_on_eight_devices(devices):
  """Stacked layer params under FSDP + tensor sharding train exactly like the plain step."""
  batches = synthetic_batches(2, 8, 16, vocab=64, seed=3)
  losses = {}
  for name, devs, shape, remat, scan in [('plain', devices[:1], (1, 1, 1), 'none', False),
                                         ('scan', devices, (2, 2, 2), 'full', True)]:
    config = tiny_model_config(2, remat=remat, scan_layers=scan)
    config.mesh.shape = shape
    losses[name], _ = step_losses(config, devs, batches)
  np.testing.assert_allclose(losses['plain'], losses['scan'], rtol=2e-5)


def test_tpu_flags_join_libtpu_init_args_and_the_users_values_win():
  """The TPU compiler flags go into LIBTPU_INIT_ARGS once; a flag the user set keeps the
  user's value; MTP_JAX_TPU_FLAGS=0 leaves the variable alone."""
  env = {'LIBTPU_INIT_ARGS': '--xla_tpu_enable_async_collective_fusion=false --other=1'}
  out = tpu_flags.apply(env).split()
  assert out[:2] == ['--xla_tpu_enable_async_collective_fusion=false', '--other=1']
  assert '--xla_tpu_enable_async_collective_fusion=true' not in out
  assert set(tpu_flags.FLAGS[1:]) <= set(out)
  assert tpu_flags.apply(env).split() == out  # applying twice adds nothing
  assert tpu_flags.apply({'MTP_JAX_TPU_FLAGS': '0'}) == ''
