"""Ahead-of-time TPU compiles (mtp_jax/train/aot/, mtp-aot-compile) on a CPU machine.

libtpu describes a TPU slice without a TPU; one small config is compiled once for a v5e-8
and its figures are checked against what the shardings and flops.py say, its unrolled
twin against it, and a small splash-attention call for the kernel count; the HLO reader
also reads a synthetic module. Skipped, with the reason, only where libtpu cannot load.
"""
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import REPO, load_config
from mtp_jax import config_lib
from mtp_jax.commands import aot_compile
from mtp_jax.errors import RequestError
from mtp_jax.runtime import sharding
from mtp_jax.train import aot
from mtp_jax.train.aot import report as report_lib
from mtp_jax.train.aot.devices import no_jax_cache

TOPOLOGY = 'v5e-8'


def small_config():
  """Two scanned layers whose widths are multiples of 128 (TPU tiles hold them unpadded)."""
  c = load_config('tiny')
  m = c.model
  m.vocab_size, m.d_model, m.n_layers, m.mlp_dim = 512, 256, 2, 512
  m.n_heads, m.n_kv_heads, m.head_dim = 2, 2, 128
  m.dtype, m.remat, m.scan_layers, m.loss_chunk = 'bfloat16', 'block', True, 64
  m.attention_core = 'xla'  # dense attention: every FLOP is in the HLO count checked below
  m.mtp.depth = 1
  c.data.seq_len, c.data.batch_size = 128, 8
  c.mesh.shape = (2, 2, 2)
  return c


@pytest.fixture(scope='module')
def report():
  try:
    topo = aot.parse_topology(TOPOLOGY)
    devices = aot.topology_devices(topo)
  except RequestError as e:
    pytest.skip(f'libtpu cannot describe a TPU slice here: {e}')
  return aot.compile_report(small_config(), topo, devices=devices), topo


def test_topology_names():
  assert aot.parse_topology('v5p-64').shape == (2, 4, 4)  # 64 TensorCores, 32 chips
  assert aot.parse_topology('v5p-256').chips == 128
  assert aot.parse_topology('v4-8').shape == (2, 2, 1)
  assert aot.parse_topology('v5litepod-16').shape == (4, 4)
  assert aot.parse_topology('v6e-256').shape == (16, 16)
  assert aot.parse_topology('v5e-1').chips == 1
  assert aot.parse_topology('v5p-16', num_slices=2).chips == 16
  for bad in ('v5p-63', 'v6e-512', 'v9-8', 'tpu', 'v5e-3'):
    with pytest.raises(RequestError, match='--topology'):
      aot.parse_topology(bad)


def test_argument_bytes_are_the_state_over_its_shards(report):
  rep, _ = report
  mesh = rep['mesh']
  assert mesh == {'data': 2, 'stage': 1, 'fsdp': 2, 'context': 1, 'tensor': 2}
  # per chip: every parameter's bytes over the mesh axes its spec names
  expected = 0
  for info in rep['params'].values():
    full = math.prod(info['shape']) * (4 if info['dtype'] == 'float32' else 2)
    spec = () if info['spec'] == 'replicated' else eval(info['spec'])  # noqa: S307
    ways = math.prod(mesh[a] for axes in spec if axes
                     for a in ((axes,) if isinstance(axes, str) else axes))
    expected += full // ways
  assert rep['param_bytes'] == expected
  assert 1.9 < rep['optimizer_bytes'] / rep['param_bytes'] < 2.1  # Adam's two moments
  state = rep['param_bytes'] + rep['optimizer_bytes'] + rep['batch_bytes']
  args = rep['train']['memory']['argument']
  assert 0.95 < args / state < 1.25, (args, state)  # TPU tiles pad a few small arrays
  assert rep['train']['fits'] and rep['train']['memory']['total'] < rep['chip']['hbm_bytes']


def test_flops_agree_with_flops_py(report):
  rep, _ = report
  train = rep['train']
  # flops.py's count plus what the compiled step does on top (aot.expected_compiled_flops:
  # the masked half of the T x T scores, remat block's recomputed attention core,
  # the rematerialised vocab chunks) -- within a few percent
  assert 0.98 < train['flops_ratio_vs_expected'] < 1.04, train['flops_ratio_vs_expected']
  assert train['flops_ratio_vs_noncausal'] > train['flops_ratio_vs_expected']
  assert train['flops_ratio_vs_flops_py'] > 1.0
  # cost_analysis counts the scanned layers' loop body once; the HLO count does not
  assert train['hlo_matmul_flops'] > train['cost_analysis']['flops'] * 0.5
  assert rep['eval']['hlo_matmul_flops'] < train['hlo_matmul_flops'] / 2


def test_shardings_follow_the_rules(report):
  rep, _ = report
  rules = dict(config_lib.DEFAULT_RULES)
  gate = rep['params']['layers.0.mlp.gate_proj.kernel.value']
  assert eval(gate['spec']) == (rules['embed'], rules['mlp'])  # noqa: S307
  emb = rep['params']['embed.embedding.value']
  assert eval(emb['spec']) == (rules['vocab'], rules['embed'])  # noqa: S307
  assert not rep['replicated_params']
  coll = rep['train']['collectives']
  assert coll['all-gather']['count'] > 0 and coll['all-reduce']['count'] > 0  # FSDP + DP
  assert rep['decode']['num_drafts'] == 1 and rep['decode']['fits']
  est = rep['train']['estimate']
  assert est['step_s'] > 0 and 0 < est['mfu'] < 1


def test_report_text_and_command_line(report, capsys):
  rep, _ = report
  text = aot.format_report(rep)
  for word in ('HBM per chip', 'flops.py', 'collectives per step', 'a lower bound on the step',
               "priced by the TPU compiler's cost model", 'costliest ops'):
    assert word in text
  # bad input: one line, exit 2, before anything compiles
  assert aot_compile.main(['--config', f'{REPO}/configs/tiny.py', '--topology', 'v9-8']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('error: --topology')


def test_the_step_is_priced_by_the_compiler_with_a_table_of_its_costliest_ops(report):
  """The headline step time is the TPU compiler's own cycle estimates summed over the
  executed ops; the roofline beside it is a lower bound; the JSON names the costliest ops."""
  rep, _ = report
  train = rep['train']
  priced, bound = train['priced'], train['estimate']
  assert priced['basis'] == 'compiler' and priced['ops_with_cycles'] > 0
  assert priced['clock_ghz'] == rep['chip']['clock_ghz'] == 1.5  # v5e
  assert priced['by_basis']['compiler'] > 0.5 * priced['step_s']
  assert priced['step_s'] == pytest.approx(sum(priced['by_basis'].values()))
  assert priced['step_s'] >= bound['step_s'] and 0 < priced['mfu'] <= bound['mfu']
  assert 'lower bound' in bound['bound']
  table = json.loads(json.dumps(rep))['train']['priced']['top_ops']  # as --json prints it
  assert len(table) == aot.pricing.TOP_OPS
  for row in table:
    assert {'name', 'kind', 'basis', 'runs', 'time_s', 'share', 'source'} <= set(row)
  times = [row['time_s'] for row in table]
  assert times == sorted(times, reverse=True) and times[0] > 0
  assert table[0]['share'] == pytest.approx(times[0] / priced['step_s'])
  assert sum(row['share'] for row in table) <= 1.0


def test_a_rerun_reads_the_figures_back(report, tmp_path):
  _, topo = report
  first = aot.compile_report(small_config(), topo, ('eval',), cache_dir=str(tmp_path))
  again = aot.compile_report(small_config(), topo, ('eval',), cache_dir=str(tmp_path))
  assert not first['eval']['cached'] and again['eval']['cached']
  assert again['eval']['memory'] == first['eval']['memory']
  assert again['eval']['hlo_matmul_flops'] == first['eval']['hlo_matmul_flops']


TOO_BIG = """from mtp_jax import config_lib


def get_config():
  c = config_lib.base_config()
  c.model.vocab_size = 4194304  # untied: 2 x 4 GiB of float32 tables, 3x with Adam
  c.model.d_model, c.model.n_layers, c.model.mlp_dim = 256, 1, 512
  c.model.tie_embeddings = False
  c.model.mtp.depth = 0
  c.data.seq_len, c.data.batch_size = 128, 2
  c.mesh.shape = (1, 1, 1)
  return c
"""


def test_too_small_a_topology_fails_in_one_line(report, tmp_path, capsys):
  """24 GiB of embedding, head and Adam moments do not fit one 16 GB v5e chip."""
  path = tmp_path / 'too_big.py'
  path.write_text(TOO_BIG)
  code = aot_compile.main(['--config', str(path), '--topology', 'v5e-1', '--programs', 'train',
                           '--cache_dir', ''])
  err = [line for line in capsys.readouterr().err.splitlines() if line.startswith('error:')]
  assert code == 1, err
  assert len(err) == 1 and 'does not fit v5e-1' in err[0] and 'short by' in err[0], err


def test_multislice_mesh_spans_the_slices_with_the_data_axis(report):
  """Two v5p-16 slices (8 chips each): data = 2 runs across the slices, fsdp inside one."""
  topo = aot.parse_topology('v5p-16', num_slices=2)
  devices = aot.topology_devices(topo)
  config = small_config()
  config.mesh.shape = (2, 8, 1)
  mesh = sharding.make_mesh(config, devices)
  grid = mesh.devices.reshape(mesh.shape['data'], mesh.shape['fsdp'])  # the other axes are 1
  slices = [[d.slice_index for d in row] for row in grid]
  assert slices == [[0] * 8, [1] * 8]


def test_moe_experts_are_multiplied_where_they_are_stored(report, tmp_path):
  """A small DeepSeekMoE step on the same slice (8 routed experts over 'data', 4 per chip):
  it fits, each chip multiplies its own experts' rows in the TPU grouped-matmul kernel
  (forward, its recomputation under remat 'block' -- without a capacity factor the
  products are not kept -- and both gradients: 4 kernels per product per layer), and the
  rows travel to their experts' chips and back by ragged all-to-all."""
  _, topo = report
  c = small_config()
  m = c.model
  m.mlp, m.mtp.depth = 'moe', 0
  m.moe.first_k_dense, m.moe.n_routed_experts, m.moe.num_experts_per_tok = 0, 8, 2
  m.moe.moe_intermediate_size, m.moe.n_shared_experts = 256, 1  # 128 per tensor shard
  rep = aot.compile_report(c, topo, programs=('train',), devices=aot.topology_devices(topo),
                           dump_dir=str(tmp_path))
  kernel = next(v for k, v in rep['params'].items() if k.endswith('experts.gate_proj.value'))
  assert eval(kernel['spec'])[0] == 'data'  # noqa: S307
  assert kernel['bytes_per_chip'] == 8 * 256 * 256 * 4 // 8  # 4 experts, a quarter of each
  train = rep['train']
  assert train['fits']
  assert train['kernel_calls'] == 2 * 3 * 4, train['kernel_calls']  # layers x products x 4
  assert train['kernels']['grouped_matmul']['flops'] > 0
  assert train['collectives']['ragged-all-to-all']['count'] > 0, train['collectives']
  # Each exchange writes into a buffer allocated in its own layer: none is a copy of a
  # loop-carried buffer (what a receive buffer hoisted out of the scan of layers becomes).
  with open(tmp_path / 'train.hlo.txt', encoding='utf-8') as f:
    defs = {m.group(1): m.group(2) for m in re.finditer(
        r'^\s*(?:ROOT )?%(\S+) = [^=]*? ([\w-]+)\(', f.read(), re.M)}
  with open(tmp_path / 'train.hlo.txt', encoding='utf-8') as f:
    buffers = re.findall(r'ragged-all-to-all\(%[^,]+, %([^,\s]+)', f.read())
  assert buffers
  with open(tmp_path / 'train.hlo.txt', encoding='utf-8') as f:
    copied = dict(re.findall(r'^\s*%(\S+) = \S+ copy\(%([^)]+)\)', f.read(), re.M))
  assert not [b for b in buffers if b in copied and defs.get(copied[b]) == 'get-tuple-element']


# -- the HLO reader ------------------------------------------------------------------------
# A module as the TPU compiler prints it: a loop of 6 dots, and a Pallas kernel call whose
# kernel metadata spans lines, one of them starting with '}}' (as libtpu prints a splash
# call), before the loop and the root.
MULTILINE_HLO = r"""HloModule jit_step, entry_computation_layout={(f32[8,8]{1,0})->f32[8,8]{1,0}}

%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  %y = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,8]{1,0}) tuple(%i.next, %y)
}

%cond (p.1: (s32[], f32[8,8])) -> pred[] {
  %p.1 = (s32[], f32[8,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: f32[8,8], q: bf16[4,256,128], k: bf16[256,128], v: bf16[256,128]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %q = bf16[4,256,128]{2,1,0} parameter(1)
  %k = bf16[256,128]{1,0} parameter(2)
  %v = bf16[256,128]{1,0} parameter(3)
  %data_next = s8[1,2,2]{2,1,0} constant({ { { 0, 0 }, { 0, 1 } } })
  %block_mask = s8[1,2,2]{2,1,0} constant({ { { 1, 0 }, { 2, 1 } } })
  %splash_mqa_fwd.1 = (bf16[4,256,128]{2,1,0}, f32[4,256,128]{2,1,0}) custom-call(%data_next, %block_mask, %q, %k, %v), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\"block_q\": 128, \"block_kv\": 128, \"q_layout\": 1}"
}}, metadata={op_name="jit(step)/splash_mqa_fwd/pallas_call"}, backend_config={"custom_call_config":{"body":"TUzvUgFN"}}
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,8]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[8,8]{1,0}) while(%init), condition=%cond, body=%body
  %out = f32[8,8]{1,0} get-tuple-element(%w), index=1
  ROOT %r = f32[8,8]{1,0} dot(%out, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_the_hlo_reader_keeps_what_follows_a_kernel_call_printed_over_lines():
  comps, _, entry = aot.read_computations(MULTILINE_HLO)
  assert entry == 'main'
  assert [i[0] for i in comps['main']][-4:] == ['init', 'w', 'out', 'r']
  stats = aot.analyze_hlo(MULTILINE_HLO, 1)
  dot = 2 * 8 * 8 * 8
  # 4 query heads x 256 x 256 positions, 3 of the 4 128-blocks kept (causal), QK^T and PV
  splash = 2 * (4 * 256 * 256 * 3 / 4) * (128 + 128)
  assert stats.kernels['splash_attention']['by_name'] == {'splash_mqa_fwd': 1.0}
  assert stats.kernels['splash_attention']['causal_assumed'] == 0
  assert stats.kernel_flops == splash
  assert stats.matmul_flops == 6 * dot + dot + splash
  # HBM: the loop body (the dot: two operands and its result, and the counter's add) and
  # its condition (the compare) run 6 times; cost_analysis's way counts them once
  body = 3 * 8 * 8 * 4 + 3 * 4
  cond = 4 + 4 + 1
  assert stats.hbm_bytes - stats.hbm_bytes_once == 5 * (body + cond)
  # the kernel reads its two block tables, q, k and v and writes its two results, and
  # reads the key/value blocks again for each kept pair (4 heads x 2 query blocks x 3/4)
  io = 2 * 4 + (4 * 256 * 128 * 2 + 2 * 256 * 128 * 2) + 4 * 256 * 128 * (2 + 4)
  reread = 4 * 0.75 * 2 * 256 * (128 + 128) * 2 - 2 * 256 * 128 * 2
  assert stats.kernels['splash_attention']['hbm_bytes'] == io + reread


# A scheduled module as the TPU compiler prints it: a loop over 4 stacked layers whose fusion
# reads its layer's slice of the [4, 8, 128] stack through a nested fusion and carries the
# compiler's cycle estimate; after it a reduce-scatter (an all-reduce and the slice each
# chip keeps, fused), an all-reduce, and an asynchronous copy that a fusion hides.
PRICED_HLO = r"""HloModule jit_priced, is_scheduled=true

%slice_read (p0: f32[4,8,128], p1: s32[]) -> f32[1,8,128] {
  %p0 = f32[4,8,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,8,128]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,128}
}

%layer (q0: f32[4,8,128], q1: s32[], q2: f32[8,128]) -> f32[8,128] {
  %q0 = f32[4,8,128]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %q2 = f32[8,128]{1,0} parameter(2)
  %nested = f32[1,8,128]{2,1,0} fusion(%q0, %q1), kind=kLoop, calls=%slice_read
  %b = f32[8,128]{1,0} bitcast(%nested)
  ROOT %sum = f32[8,128]{1,0} add(%b, %q2)
}

%body (p: (s32[], f32[8,128], f32[4,8,128])) -> (s32[], f32[8,128], f32[4,8,128]) {
  %p = (s32[], f32[8,128]{1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,128]{1,0} get-tuple-element(%p), index=1
  %w = f32[4,8,128]{2,1,0} get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %i.next = s32[] add(%i, %one)
  %y = f32[8,128]{1,0} fusion(%w, %i, %x), kind=kLoop, calls=%layer, metadata={op_name="jit(step)/while/body/add"}, backend_config={"flag_configs":[],"window_config":{"estimated_cycles":"1750","iteration_bounds":["1"]}}
  ROOT %t = (s32[], f32[8,128]{1,0}, f32[4,8,128]{2,1,0}) tuple(%i.next, %y, %w)
}

%cond (c: (s32[], f32[8,128], f32[4,8,128])) -> pred[] {
  %c = (s32[], f32[8,128]{1,0}, f32[4,8,128]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

%sum_f32 (lhs: f32[], rhs: f32[]) -> f32[] {
  %lhs = f32[] parameter(0)
  %rhs = f32[] parameter(1)
  ROOT %s = f32[] add(%lhs, %rhs)
}

%all-reduce-scatter.1 (in: f32[64,128]) -> f32[16,128] {
  %in = f32[64,128]{1,0} parameter(0)
  %ar.1 = f32[64,128]{1,0} all-reduce(%in), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%sum_f32
  %pid = u32[] partition-id()
  %c16 = u32[] constant(16)
  %off = u32[] multiply(%pid, %c16)
  %c0 = u32[] constant(0)
  ROOT %ds.1 = f32[16,128]{1,0} dynamic-slice(%ar.1, %off, %c0), dynamic_slice_sizes={16,128}
}

%scale (s0: f32[8,128]) -> f32[8,128] {
  %s0 = f32[8,128]{1,0} parameter(0)
  ROOT %m = f32[8,128]{1,0} multiply(%s0, %s0)
}

ENTRY %main (a: f32[8,128], w0: f32[4,8,128], g: f32[64,128]) -> (f32[8,128], f32[16,128], f32[64,128]) {
  %a = f32[8,128]{1,0} parameter(0)
  %w0 = f32[4,8,128]{2,1,0} parameter(1)
  %g = f32[64,128]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,128]{1,0}, f32[4,8,128]{2,1,0}) tuple(%zero, %a, %w0)
  %loop = (s32[], f32[8,128]{1,0}, f32[4,8,128]{2,1,0}) while(%init), condition=%cond, body=%body
  %h = f32[8,128]{1,0} get-tuple-element(%loop), index=1
  %rs = f32[16,128]{1,0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
  %ar = f32[64,128]{1,0} all-reduce(%g), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%sum_f32
  %cs = (f32[8,128]{1,0:S(1)}, f32[8,128]{1,0}, u32[]{:S(2)}) copy-start(%h)
  %e = f32[8,128]{1,0} fusion(%h), kind=kLoop, calls=%scale, backend_config={"window_config":{"estimated_cycles":"3500"}}
  %cd = f32[8,128]{1,0:S(1)} copy-done(%cs)
  ROOT %out = (f32[8,128]{1,0}, f32[16,128]{1,0}, f32[64,128]{1,0}) tuple(%e, %rs, %ar)
}
"""


def test_the_step_is_priced_from_the_compilers_cycle_estimates():
  """estimated_cycles read from each executed op, a loop body's times its trip count, at
  the chip's clock; collectives by what they are; a slice of a stack read as the slice."""
  stats = aot.analyze_hlo(PRICED_HLO, 4)
  ops = {op.name: op for body in stats.executed.values() for op in body}
  assert 'ds' not in ops and 'ar.1' not in ops  # fusion bodies are not executed ops
  assert (ops['y'].cycles, ops['y'].runs, ops['e'].cycles, ops['e'].runs) == (1750, 4, 3500, 1)
  # the layer fusion reads its [1, 8, 128] slice of the stack (through the nested fusion),
  # the counter and the carried [8, 128], and writes [8, 128]
  row = 8 * 128 * 4
  assert ops['y'].hbm_bytes == row + 4 + row + row
  # the fused all-reduce + slice is a reduce-scatter of the [64, 128] array: each chip sends
  # 3/4 of it once; the all-reduce twice that; the one inside the fusion is not another
  full = 64 * 128 * 4
  coll = stats.collectives
  assert coll['reduce-scatter']['count'] == 1 and coll['reduce-scatter']['bytes'] == full
  assert coll['reduce-scatter']['ici_bytes'] == full * 3 / 4
  assert coll['all-reduce']['count'] == 1 and coll['all-reduce']['ici_bytes'] == 2 * full * 3 / 4
  assert ops['rs'].kind == 'reduce-scatter' and ops['y'].kind == 'loop fusion'
  chip = aot.parse_topology('v5p-8').chip  # 1.75 GHz, ICI 1200 GB/s
  priced = aot.price_step(stats, chip)
  assert priced['basis'] == 'compiler'
  assert priced['by_basis']['compiler'] == pytest.approx((4 * 1750 + 3500) / 1.75e9)
  assert priced['by_basis']['ICI'] == pytest.approx(full * 3 / 4 * 3 / 1.2e12)
  # the copy runs under the fusion scheduled between its start and its done: it costs
  # nothing; started after that fusion, it is exposed
  names = [r['name'] for r in aot.price_step(stats, chip, top=100)['top_ops']]
  assert 'e' in names and 'cs' not in names
  start = '  %cs = (f32[8,128]{1,0:S(1)}, f32[8,128]{1,0}, u32[]{:S(2)}) copy-start(%h)\n'
  done = '  %cd = f32[8,128]{1,0:S(1)} copy-done(%cs)\n'
  late = PRICED_HLO.replace(start, '').replace(done, start + done)
  exposed = aot.price_step(aot.analyze_hlo(late, 4), chip, top=100)['top_ops']
  assert next(r for r in exposed if r['name'] == 'cs')['time_s'] == pytest.approx(
      2 * row / chip.hbm_bandwidth)
  top = priced['top_ops'][0]
  assert (top['name'], top['basis'], top['runs']) == ('y', 'compiler', 4)
  assert top['time_s'] == pytest.approx(4 * 1750 / 1.75e9)
  assert top['source'] == 'jit(step)/while/body/add'
  # a module without the compiler's estimates (a GPU's) is priced op by op at the roofline
  plain = aot.analyze_hlo(PRICED_HLO.replace('"estimated_cycles"', '"other"'), 4)
  bound = aot.price_step(plain, chip)
  assert bound['basis'] == 'roofline' and bound['by_basis']['compiler'] == 0
  assert bound['step_s'] < priced['step_s']
  # where a GPU module carries the compiler's own time for an op, that prices it
  timed = PRICED_HLO.replace('"estimated_cycles":"1750"', '"reification_cost":[{"exec_time_us":2.5}]')
  gpu = aot.price_step(aot.analyze_hlo(timed, 4), aot.parse_topology('h100-1').chip, top=100)
  y = next(r for r in gpu['top_ops'] if r['name'] == 'y')
  assert (y['basis'], y['time_s']) == ('compiler', pytest.approx(4 * 2.5e-6))


BRANCHES_HLO = r"""HloModule jit_branches, is_scheduled=true

%cheap (a.1: f32[8,128]) -> f32[8,128] {
  %a.1 = f32[8,128]{1,0} parameter(0)
  ROOT %f.1 = f32[8,128]{1,0} fusion(%a.1), kind=kLoop, calls=%neg, backend_config={"window_config":{"estimated_cycles":"1000"}}
}

%costly (a.2: f32[8,128]) -> f32[8,128] {
  %a.2 = f32[8,128]{1,0} parameter(0)
  ROOT %f.2 = f32[8,128]{1,0} fusion(%a.2), kind=kLoop, calls=%neg, backend_config={"window_config":{"estimated_cycles":"3000"}}
}

%neg (n0: f32[8,128]) -> f32[8,128] {
  %n0 = f32[8,128]{1,0} parameter(0)
  ROOT %n1 = f32[8,128]{1,0} negate(%n0)
}

ENTRY %main (p: s32[], a: f32[8,128]) -> f32[8,128] {
  %p = s32[] parameter(0)
  %a = f32[8,128]{1,0} parameter(1)
  ROOT %c = f32[8,128]{1,0} conditional(%p, %a, %a), branch_computations={%cheap, %costly}
}
"""


def test_a_conditional_is_priced_at_its_costliest_branch():
  stats = aot.analyze_hlo(BRANCHES_HLO, 1)
  assert stats.conditionals == 1
  priced = aot.price_step(stats, aot.parse_topology('v5p-8').chip)
  assert priced['step_s'] == pytest.approx(3000 / 1.75e9)
  assert [r['name'] for r in priced['top_ops']] == ['f.2', 'f.1']  # each branch listed



def _unrolled_hlo(cycles_of_last: str) -> str:
  """Three layers' copies of one fusion (one JAX source), the last at `cycles_of_last`."""
  op = ('  %{name} = f32[8,128]{{1,0}} fusion(%{arg}), kind=kLoop, calls=%neg, '
        'metadata={{op_name="jit(step)/layer/neg"}}, '
        'backend_config={{"window_config":{{"estimated_cycles":"{cycles}"}}}}\n')
  body = (op.format(name='l.0', arg='a', cycles='1000') + op.format(name='l.1', arg='l.0', cycles='1000')
          + op.format(name='l.2', arg='l.1', cycles=cycles_of_last))
  return ('HloModule jit_unrolled, is_scheduled=true\n\n'
          '%neg (n0: f32[8,128]) -> f32[8,128] {\n  %n0 = f32[8,128]{1,0} parameter(0)\n'
          '  ROOT %n1 = f32[8,128]{1,0} negate(%n0)\n}\n\n'
          'ENTRY %main (a: f32[8,128]) -> f32[8,128] {\n  %a = f32[8,128]{1,0} parameter(0)\n'
          + body.replace('  %l.2', '  ROOT %l.2') + '}\n')


def test_unrolled_layers_ops_are_one_row_of_the_costliest_ops():
  """An unrolled stack repeats each layer's ops under new names: alike ops (instruction,
  source, cost) are one row with their runs summed; an op that costs otherwise is its own."""
  chip = aot.parse_topology('v5p-8').chip
  priced = aot.price_step(aot.analyze_hlo(_unrolled_hlo('1000'), 1), chip)
  (row,) = priced['top_ops']
  assert (row['name'], row['ops'], row['runs']) == ('l.0', 3, 3)
  assert row['time_s'] == pytest.approx(3000 / 1.75e9) and row['share'] == pytest.approx(1.0)
  assert '(and 2 alike)' in '\n'.join(report_lib.top_ops_lines(priced))
  apart = aot.price_step(aot.analyze_hlo(_unrolled_hlo('4000'), 1), chip)['top_ops']
  assert [(r['name'], r['ops']) for r in apart] == [('l.2', 1), ('l.0', 2)]


# The TPU's asynchronous collective fusion: one all-gather (channel 7) of a [2, 128] shard
# into [8, 128] as a start fusion, a matmul fusion that carries a step of it beside its
# own dot, and a done fusion, with an elementwise fusion scheduled between start and done.
ASYNC_HLO = r"""HloModule jit_async, is_scheduled=true

%start_body (s0: bf16[2,128]) -> (bf16[2,128], bf16[8,128], u32[]) {
  %s0 = bf16[2,128]{1,0} parameter(0)
  %ag.1 = bf16[8,128]{1,0} all-gather(%s0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cc.1 = (bf16[2,128]{1,0}, bf16[8,128]{1,0}, u32[]{:S(2)}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%step_body (m0: bf16[2,128], m1: bf16[8,128], m2: bf16[512,128], m3: bf16[128,128]) -> (bf16[512,128], bf16[8,128]) {
  %m0 = bf16[2,128]{1,0} parameter(0)
  %m1 = bf16[8,128]{1,0} parameter(1)
  %m2 = bf16[512,128]{1,0} parameter(2)
  %m3 = bf16[128,128]{1,0} parameter(3)
  %ag.2 = bf16[8,128]{1,0} all-gather(%m0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
  %mm = bf16[512,128]{1,0} convolution(%m2, %m3), dim_labels=bf_io->bf
  ROOT %t.2 = (bf16[512,128]{1,0}, bf16[8,128]{1,0}) tuple(%mm, %ag.2)
}

%done_body (d0: bf16[2,128], d1: bf16[8,128]) -> bf16[8,128] {
  %d0 = bf16[2,128]{1,0} parameter(0)
  %d1 = bf16[8,128]{1,0} parameter(1)
  %ag.3 = bf16[8,128]{1,0} all-gather(%d0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %cc.3 = bf16[8,128]{1,0} custom-call(%d0, %d1, %ag.3), custom_call_target="AsyncCollectiveDone"
}

%neg (n0: bf16[512,128]) -> bf16[512,128] {
  %n0 = bf16[512,128]{1,0} parameter(0)
  ROOT %n1 = bf16[512,128]{1,0} negate(%n0)
}

ENTRY %main (w: bf16[2,128], x: bf16[512,128], k: bf16[128,128]) -> (bf16[512,128], bf16[8,128]) {
  %w = bf16[2,128]{1,0} parameter(0)
  %x = bf16[512,128]{1,0} parameter(1)
  %k = bf16[128,128]{1,0} parameter(2)
  %async-collective-start.1 = (bf16[2,128]{1,0}, bf16[8,128]{1,0}, u32[]{:S(2)}) fusion(%w), kind=kCustom, calls=%start_body
  %g0 = bf16[2,128]{1,0} get-tuple-element(%async-collective-start.1), index=0
  %g1 = bf16[8,128]{1,0} get-tuple-element(%async-collective-start.1), index=1
  %e = bf16[512,128]{1,0} fusion(%x), kind=kLoop, calls=%neg, backend_config={"window_config":{"estimated_cycles":"1750"}}
  %async_collective_fusion.1 = (bf16[512,128]{1,0}, bf16[8,128]{1,0}) fusion(%g0, %g1, %e, %k), kind=kOutput, calls=%step_body, backend_config={"window_config":{"estimated_cycles":"3500"}}
  %y = bf16[512,128]{1,0} get-tuple-element(%async_collective_fusion.1), index=0
  %g2 = bf16[8,128]{1,0} get-tuple-element(%async_collective_fusion.1), index=1
  %async-collective-done.1 = bf16[8,128]{1,0} fusion(%g0, %g2), kind=kCustom, calls=%done_body
  ROOT %out = (bf16[512,128]{1,0}, bf16[8,128]{1,0}) tuple(%y, %async-collective-done.1)
}
"""


def test_an_asynchronous_collective_fusion_is_one_collective_of_its_own_bytes():
  """The start, the matmul carrying a step and the done of one all-gather count it once,
  at the gathered array's bytes (not the matmul fusion's operands and results); the
  matmul fusion is priced as a matmul by its cycles, the done moves nothing, and the
  start's ICI time is hidden by the fusions scheduled before its done."""
  stats = aot.analyze_hlo(ASYNC_HLO, 4)
  gathered = 8 * 128 * 2
  assert set(stats.collectives) == {'all-gather'}
  ag = stats.collectives['all-gather']
  assert (ag['count'], ag['bytes'], ag['ici_bytes']) == (1, gathered, gathered * 3 / 4)
  ops = {op.name: op for op in stats.executed['main']}
  start, step, done = (ops[n] for n in ('async-collective-start.1', 'async_collective_fusion.1',
                                         'async-collective-done.1'))
  assert (start.kind, step.kind, done.kind) == ('all-gather', 'convolution fusion',
                                               'all-gather done')
  assert start.done == 'async-collective-done.1' and done.hbm_bytes == 0
  assert step.ici_bytes == 0 and step.cycles == 3500
  chip = aot.parse_topology('v5p-8').chip
  priced = aot.price_step(stats, chip, top=100)
  assert priced['step_s'] == pytest.approx((1750 + 3500) / 1.75e9)  # the gather is hidden
  assert priced['by_kind'] == {'convolution fusion': pytest.approx(3500 / 1.75e9),
                               'loop fusion': pytest.approx(1750 / 1.75e9)}

def test_causal_kept_blocks():
  assert aot.causal_kept_fraction(1024, 1024, 512, 512) == 3 / 4
  assert aot.causal_kept_fraction(4096, 4096, 512, 512) == 36 / 64
  assert aot.causal_kept_fraction(1024, 1024, 256, 512) == 6 / 8  # rows 0-255 reach block 0
  assert aot.causal_kept_fraction(128, 128, 512, 512) == 1.0


def test_scanned_and_unscanned_layers_count_the_same(report):
  """cost_analysis counts the scanned layers' loop body once, in FLOPs and in bytes; the
  report weights it by its trip count, so the same 2-layer model unrolled reads the same."""
  rep, topo = report
  c = small_config()
  c.model.scan_layers = False
  flat = aot.compile_report(c, topo, ('train',), devices=aot.topology_devices(topo))['train']
  scanned = rep['train']
  assert scanned['unknown_trip_counts'] == 0
  assert abs(scanned['hlo_matmul_flops'] / flat['hlo_matmul_flops'] - 1) < 0.05
  assert abs(scanned['hbm_bytes'] / flat['hbm_bytes'] - 1) < 0.05, (scanned['hbm_bytes'],
                                                                     flat['hbm_bytes'])
  # what cost_analysis reads for the scanned program falls short of the unrolled one's by
  # about a layer (the report's slice-read count is below cost_analysis's own, so compare
  # cost_analysis with itself)
  assert (scanned['cost_analysis']['bytes_accessed']
          < 0.95 * flat['cost_analysis']['bytes_accessed']), (
              scanned['cost_analysis']['bytes_accessed'], flat['cost_analysis']['bytes_accessed'])
  assert scanned['cost_analysis']['flops'] < 0.8 * scanned['hlo_matmul_flops']
  # counted each computation once, the reader's bytes are XLA's own figure's, less what
  # cost_analysis charges for a whole array where a nested fusion reads one slice of it
  assert 0.8 < flat['hbm_bytes_once'] / flat['cost_analysis']['bytes_accessed'] <= 1.0
  assert scanned['estimate']['hbm_bytes'] == scanned['hbm_bytes']


def test_a_fused_splash_backward_is_counted_with_its_dq():
  """splash's fused backward (BlockSizes(use_fused_bwd_kernel=True)) forms dQ in the dkv
  pass and returns its partial sums per key block as an extra result; its metadata does
  not say so. The result's shape tells: the pass is then counted with dQ's matmul."""
  from mtp_jax.train.aot import kernels
  heads, t, d = 4, 256, 128
  q = ('bf16', [heads, t, d])
  operands = [('data_next', [('s8', [1, 2, 2])]), ('block_mask', [('s8', [1, 2, 2])]),
              ('q', [q]), ('k', [q]), ('v', [q])]
  text = ('splash_mha_dkv.1 = custom-call(...), kernel_metadata={"xprof_metadata":'
          '"{\\"block_q_dkv\\": 128, \\"block_kv_dkv\\": 128}"}')
  constants = {'block_mask': [1, 0, 1, 1]}
  split = kernels.kernel_call('tpu_custom_call', text, [q, q], operands, constants)
  fused = kernels.kernel_call('tpu_custom_call', text, [q, q, ('bf16', [2, heads, t, d])],
                              operands, constants)
  pairs = heads * t * t * 3 / 4
  assert split.flops == 2 * pairs * (2 * d + 2 * d)  # QK^T and dP again, dK, dV
  assert fused.flops == 2 * pairs * (3 * d + 2 * d)  # and dQ
  assert split.name == fused.name == 'splash_mha_dkv'


def test_splash_kernel_calls_are_counted_from_their_shapes(report):
  """A causal splash attention (Pallas TPU kernel, one sequence per chip inside shard_map)
  compiled for the slice: its forward, dq and dkv calls and their FLOPs, which
  cost_analysis does not see."""
  _, topo = report
  devices = aot.topology_devices(topo)
  mesh = jax.sharding.Mesh(devices, ('data',))
  h, t, d = 2, 1024, 128
  kernel = splash.make_splash_mha_single_device(
      masks.MultiHeadMask([masks.CausalMask((t, t))] * h),
      block_sizes=splash.BlockSizes(*(512,) * 8))

  def attention(q, k, v, seg):
    def per_chip(q, k, v, seg):
      out = jax.vmap(lambda *a: kernel(*a[:3], segment_ids=splash.SegmentIds(a[3], a[3])))(
          q, k, v, seg)
      return out
    return jax.shard_map(per_chip, mesh=mesh, in_specs=P('data'), out_specs=P('data'),
                         check_vma=False)(q, k, v, seg).astype(jnp.float32).sum()

  shard = NamedSharding(mesh, P('data'))
  qkv = jax.ShapeDtypeStruct((8, h, t, d), jnp.bfloat16, sharding=shard)
  seg = jax.ShapeDtypeStruct((8, t), jnp.int32, sharding=shard)
  with aot.traced_for('tpu'), no_jax_cache():  # a CPU-side cache cannot hold a TPU program
    compiled = jax.jit(jax.grad(attention, argnums=(0, 1, 2))).lower(qkv, qkv, qkv,
                                                                     seg).compile()
  stats = aot.analyze_hlo(aot.hlo_text(compiled), 8)
  got = stats.kernels['splash_attention']
  assert stats.kernel_calls == 3 and got['causal_assumed'] == 0, got
  assert set(got['by_name']) == {'splash_mha_fwd', 'splash_mha_dq', 'splash_mha_dkv'}, got
  # 2 heads x 1024 x 1024 positions, 3 of the 4 512-blocks kept: forward QK^T and PV (2 d
  # each), dq 3 matmuls, dkv 4
  pairs = h * t * t * 3 / 4
  assert got['flops'] == 2 * pairs * d * (2 + 3 + 4)
  assert compiled.cost_analysis()['flops'] < 0.01 * got['flops']
  operands = 3 * h * t * d * 2
  assert got['hbm_bytes'] > 3 * operands  # q, k, v read by each pass, and the gradients


def test_grouped_matmul_calls_are_counted_over_the_rows_they_compute(report):
  """The TPU grouped matmul (megablox gmm, with its tgmm weight gradient) on a buffer of
  1024 rows over 4 groups: counted over the whole buffer by default, and over the rows
  received plus one tile per group where the caller says how many rows arrive."""
  _, topo = report
  device = aot.topology_devices(topo)[0]
  m, k, n, groups = 1024, 256, 256, 4

  def loss(x, w, sizes):
    return gmm(x, w, sizes, jnp.bfloat16, (128, 128, 128)).astype(jnp.float32).sum()

  one = jax.sharding.SingleDeviceSharding(device)
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=one),
          jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16, sharding=one),
          jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=one))
  with aot.traced_for('tpu'), no_jax_cache():
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
  text = aot.hlo_text(compiled)
  whole = aot.analyze_hlo(text, 1).kernels['grouped_matmul']
  assert set(whole['by_name']) == {'gmm', 'tgmm'}, whole
  calls = whole['calls']  # forward, the input gradient (gmm) and the weight gradient (tgmm)
  assert calls == 3 and whole['flops'] == calls * 2 * m * k * n, whole
  received = aot.analyze_hlo(text, 1, grouped_rows=300).kernels['grouped_matmul']
  assert received['flops'] == calls * 2 * (300 + groups * 128) * k * n, received
  assert received['hbm_bytes'] < whole['hbm_bytes']
  # more rows received than the buffer holds: the buffer bounds it
  assert aot.analyze_hlo(text, 1, grouped_rows=4096).kernels['grouped_matmul'] == whole


def test_the_splash_model_holds_the_expected_flops(report):
  """The small model with the splash core (the TPU default): three kernel calls per
  attention (forward, dq, dkv; remat 'block' keeps the forward's output and residuals),
  their FLOPs counted from the kept blocks, and the step's count equal to the expected
  one for that core."""
  _, topo = report
  c = small_config()
  c.model.attention_core = 'splash'
  c.data.seq_len = 256
  c.model.attention_block_q = c.model.attention_block_kv = 128  # 3 of 4 blocks kept
  c.model.loss_chunk = 128
  rep = aot.compile_report(c, topo, ('train',), devices=aot.topology_devices(topo))
  train = rep['train']
  attention = c.model.n_layers + c.model.mtp.depth
  assert train['kernels']['splash_attention']['calls'] == 3 * attention, train['kernels']
  assert rep['flops_py']['expected_attention_core'] == 'splash'
  assert 0.98 < train['flops_ratio_vs_expected'] < 1.04, train['flops_ratio_vs_expected']
  # per attention and chip: 2 sequences (batch 8 over data x fsdp) x 1 head (2 over
  # tensor) x 256 x 256 x 3/4; forward 2 matmuls, dq 3, dkv 4, of width 128 each
  rows, heads = 8 // (2 * 2), 2 // 2
  per_attention = 2 * (rows * heads * 256 * 256 * 3 / 4) * 128 * (2 + 3 + 4)
  assert train['kernel_flops'] == attention * per_attention


def test_gpu_attention_kernel_calls_are_counted_from_their_shapes():
  """The Pallas Triton flash kernel as the GPU compiler prints it (an MLIR attribute
  dictionary for a backend config, the kernel's name in the op name) and a cuDNN call."""
  q = ('f32', (8, 512, 4, 16))  # [B, T, N, H]
  operands = [(n, [q]) for n in ('q', 'k', 'v')] + [('seg', [('s32', (8, 512))])]
  forward = aot.kernel_call(
      '__gpu$xla.gpu.triton', 'metadata={op_name="jit(train_step)/jvp(jit(mha))/mha_forward/'
      'pallas_call"}, backend_config={debug = false, grid_x = 4 : i32, grid_y = 8 : i32, '
      'grid_z = 4 : i32, ir = "ML\\EFR\\0D{"}', [q, ('f32', (8, 4, 512))], operands, {})
  pairs = 8 * 4 * 512 * 512 * 10 / 16  # 128-query blocks (512 / grid_x): 10 of 16 kept
  assert (forward.kind, forward.name) == ('triton_attention', 'mha_forward')
  assert forward.flops == 2 * pairs * (16 + 16)
  backward = aot.kernel_call(
      '__gpu$xla.gpu.triton', 'metadata={op_name="jit(train_step)/transpose(jvp(mha_backward))'
      '/pallas_call"}, backend_config={grid_x = 8 : i32, grid_y = 4 : i32, grid_z = 16 : i32}',
      [q, q, q], operands, {})
  pairs = 8 * 4 * 512 * 512 * 136 / 256  # 32-key blocks (512 / grid_z)
  assert backward.flops == 2 * pairs * (4 * 16 + 3 * 16)  # dK, dV loop and dQ loop
  q = ('bf16', (2, 256, 4, 64))
  cudnn = aot.kernel_call('__cudnn$fmhaSoftmax', 'backend_config={"cudnn_fmha_backend_config":'
                          '{"mask_type":"CAUSAL"}}', [q], [(n, [q]) for n in 'qkv'], {})
  assert cudnn.kind == 'cudnn_attention'
  assert cudnn.flops == 2 * (2 * 4 * 256 * 256 * 3 / 4) * (64 + 64)


def test_no_jax_cache_turns_off_a_cache_already_in_use(tmp_path):
  """JAX settles once per process whether its cache is used; the AOT tool must still bypass
  a cache an earlier training run switched on, and leave it working afterwards."""
  from mtp_jax.runtime import compile_cache

  was = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs,
         jax.config.jax_persistent_cache_min_entry_size_bytes)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  try:
    compile_cache.enable(str(tmp_path))
    entries = lambda: set(os.listdir(tmp_path))  # noqa: E731
    jax.jit(lambda x: x * 3 + 1).lower(jnp.ones(7)).compile()
    first = entries()
    assert first, 'the cache is in use before the block'
    with no_jax_cache():
      jax.jit(lambda x: x * 5 - 2).lower(jnp.ones(9)).compile()
    assert entries() == first
    jax.jit(lambda x: x * 7 + 4).lower(jnp.ones(11)).compile()
    assert len(entries()) > len(first), 'the cache works again after the block'
  finally:
    jax.config.update('jax_enable_compilation_cache', was[0])
    jax.config.update('jax_compilation_cache_dir', was[1])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', was[2])
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', was[3])
    compilation_cache.reset_cache()
