"""Every benchmark script's --smoke run (tiny shapes, one round) writes the JSON of a real run.

The smokes run in this process (the scripts' main(argv)), except where a script's own
design is a child process per variant. Their figures mean nothing; the keys, the
provenance and the invariants a real run must also satisfy (greedy speculative output
equal to AR, an A/B's variants starting from the same loss) are what is checked.
"""
import glob
import importlib
import json
import os
import pathlib
import shlex
import subprocess

import pytest

import common  # benchmarks/common.py: pytest.ini puts benchmarks/ on the path
from helpers import REPO

BENCH = os.path.join(REPO, 'benchmarks')

SCRIPTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(BENCH, '*.py'))
                 if not p.endswith('common.py'))
ENVELOPE = ('benchmark', 'command', 'commit', 'local_changes', 'machine', 'load_average', 'peak',
            'date', 'smoke', 'result')


@pytest.fixture(autouse=True)
def known_peak(monkeypatch):
  # The peak a run records: a number here, so no test probes (and caches) a loaded host's.
  monkeypatch.setenv('MTP_JAX_CPU_PEAK_FLOPS', '1e11')


@pytest.fixture
def fake_peer(tmp_path):
  """A stand-in for MaxText's run_peer.sh: one JSON line of a run at $MTP_LIST."""
  path = tmp_path / 'run_peer.sh'
  path.write_text('echo "{\\"mtp_num_layers\\": $MTP_LIST, \\"rc\\": 0, '
                  '\\"tokens_per_sec\\": 1000.0, \\"step_time_s\\": 4.1}"\n')
  return str(path)


def smoke(name, tmp_path, *argv, benchmark=None) -> dict:
  """benchmarks/<name>.py --smoke in this process: the JSON it wrote (recorded as
  `benchmark`, by default the script's name)."""
  module = importlib.import_module(name)
  out = tmp_path / f'{name}.json'
  assert module.main(['--smoke', '--out', str(out), *argv]) == 0
  doc = json.loads(out.read_text())
  assert set(ENVELOPE) <= set(doc), set(ENVELOPE) - set(doc)
  assert doc['benchmark'] == (benchmark or name) and doc['smoke'] is True
  assert doc['command'].split()[1].endswith(f'{name}.py') and '--smoke' in doc['command']
  # the recorded command pastes into a shell as it was run (a tree's ';' included)
  assert shlex.split(doc['command'])[2:] == ['--smoke', '--out', str(out), *argv]
  assert doc['machine']['cores'] >= 1 and doc['machine']['cpu']
  assert len(doc['load_average']['start']) == 3 and len(doc['load_average']['end']) == 3
  assert doc['peak']['gflops'] == pytest.approx(100.0)
  assert doc['commit'] is None or len(doc['commit']) == 12
  return doc['result']


def test_train_throughput_mfu(tmp_path):
  # one section with a committed result of its own is recorded under that result's name
  mfu = smoke('train_throughput', tmp_path, '--only', 'mfu',
              benchmark='train_mfu')['sections']['mfu']
  assert 0 < mfu['step_time_best_s'] <= mfu['step_time_median_s']
  assert mfu['tokens_per_sec_median'] == pytest.approx(
      mfu['batch_size'] * mfu['seq_len'] / mfu['step_time_median_s'])
  assert mfu['mfu_best_step_over_peak'] > 0 and mfu['model_flops_per_step'] > 0
  assert mfu['compute_dtype'] == 'float32' and mfu['step_profile']['step_s'] > 0


def _section(tmp_path, name):
  """One train_throughput section's smoke, recorded under its result's name (the sections
  are split over tests so that none runs for minutes)."""
  names = importlib.import_module('train_throughput').RESULT_NAMES
  benchmark = 'train_attention' if name == 'ab' else names.get(name, 'train_throughput')
  return smoke('train_throughput', tmp_path, '--only', name,
               benchmark=benchmark)['sections'][name]


@pytest.mark.slow
def test_train_throughput_overhead_and_maxtext(tmp_path):
  assert _section(tmp_path, 'overhead')['depths']['1']['flop_ratio'] > 1
  assert _section(tmp_path, 'maxtext')['depths']['0']['tokens_per_sec_median'] > 0


@pytest.mark.slow
def test_train_throughput_moe(tmp_path):
  moe = _section(tmp_path, 'moe')['variants']
  assert moe['dense_same_active']['time_ratio_vs_dense_median'] == 1.0
  assert moe['dsv3_mini']['flop_ratio_vs_dense'] > 0


@pytest.mark.slow
def test_train_throughput_memory_and_compile(tmp_path):
  row = _section(tmp_path, 'memory')['default_cpu_scheduler']['runs'][0]
  assert row['depth1_temp_MiB'] > 0 and row['temp_ratio_depth4_over_depth1'] > 0
  compile_s = _section(tmp_path, 'compile')
  assert all(v > 0 for k, v in compile_s.items() if k != 'bench_seconds')


@pytest.mark.slow
def test_train_throughput_ab(tmp_path):
  for variants in _section(tmp_path, 'ab')['models'].values():
    for v in variants.values():  # the same init and batch: the same first loss
      assert v['first_step_rel_diff']['loss'] < 1e-5


@pytest.mark.slow
def test_train_throughput_dtype_ab(tmp_path):
  r = smoke('train_throughput', tmp_path, '--only', 'ab', '--ab_set', 'dtype',
            benchmark='train_dtype')
  (variants,) = r['sections']['ab']['models'].values()
  f32, bf16 = variants['float32'], variants['bfloat16']
  assert (f32['compute_dtype'], bf16['compute_dtype']) == ('float32', 'bfloat16')
  assert bf16['first_step_rel_diff']['loss'] < 1e-2  # the same init and batch, bf16 rounding
  assert bf16['matmul_flops_by_dot_form']['bf16 kernels'] > 0.8  # d 32: the norms' share is larger
  assert 'bf16 kernels' not in f32['matmul_flops_by_dot_form']
  # where each variant's traced step went, by kind: its own matmul form among them
  for v, form in ((f32, 'matmul: f32 x f32 -> f32'), (bf16, 'matmul: bf16 kernels')):
    kinds = v['step_profile']['by_kind']
    assert kinds.get(form, 0) > 0 and 'host gap' in kinds, kinds


def test_decode_speed(tmp_path):
  r = smoke('decode_speed', tmp_path)
  row = r['results'][0]
  assert row['identical'] is True  # greedy speculative decoding is lossless
  assert 1.0 <= row['mean_accepted_length'] <= row['num_drafts'] + 1
  assert row['speedup'] > 0 and row['iteration_cost_ratio'] > 0
  probe = r['cost_probe'][0]['float32']  # a difference of two tiny timings: any sign
  assert {'ar_ms_per_step', 'drafts_1'} <= set(probe)


def test_tree_decode(tmp_path):
  r = smoke('tree_decode', tmp_path, '--trees', '0;1;0.0')  # --smoke decodes `2,1`
  rows = {row['variant']: row for row in r['results']}
  assert set(rows) == {'ar', 'chain 1', 'chain 2', 'tree 2,1', 'auto'}
  assert all(row.get('identical_to_ar', True) is True for row in rows.values())
  tree, chain = rows['tree 2,1'], rows['chain 2']
  assert tree['verify_rows_per_iteration'] == 5 and tree['speedup_over_ar'] > 0
  assert tree['flops_per_iteration']['flops'] > chain['flops_per_iteration']['flops']
  auto = r['auto']
  assert auto['line'].startswith('auto: ') and auto['shapes_considered'] >= 3
  assert auto['speedup_vs_best_measured'] > 0 and auto['expected_tau'] >= 1
  assert set(auto['cost']) >= {'verify', 'block', 'logits', 'base', 'per_depth'}


def test_tree_decode_result_file_merges_runs(tmp_path):
  """A run replaces the file's run of the same workdir, temperature and batch size and
  keeps the others; a file from another CPU is replaced whole."""
  module = importlib.import_module('tree_decode')
  path = str(tmp_path / 'tree_decode.json')

  def doc(cpu, temperature, batch, tag):
    return {'benchmark': 'tree_decode', 'machine': {'cpu': cpu}, 'smoke': False, 'tag': tag,
            'result': {'workdir': 'runs/m', 'temperature': temperature, 'batch_size': batch}}

  def write(d):
    merged = module.merge(path, d)
    pathlib.Path(path).write_text(json.dumps(merged))
    return merged

  write(doc('A', 0.0, 1, 'a'))
  write(doc('A', 1.0, 1, 'b'))
  m = write(doc('A', 0.0, 1, 'c'))
  assert [r['tag'] for r in m['runs']] == ['c', 'b'] and m['tag'] == 'c'
  m = write(doc('B', 0.0, 4, 'd'))
  assert [r['tag'] for r in m['runs']] == ['d']


def test_peer_generate(tmp_path):
  r = smoke('peer_generate', tmp_path)
  assert r['greedy_identical'] is True
  assert set(r['project_over_peer_paired_median']) == {'greedy', 't1'}
  assert all(v['median'] > 0 for v in r['tokens_per_sec'].values())


@pytest.mark.slow
def test_peer_generate_filters_and_switch(tmp_path):
  r = smoke('peer_generate', tmp_path, '--filters', '--ab', 'bitwise_thresholds')
  assert 'project_t1_topk50_off' in r['tokens_per_sec']
  assert set(r['on_over_off_paired_median']) >= {'project_t1', 'project_t1_topk50'}


def test_sampling_cost(tmp_path):
  r = smoke('sampling_cost', tmp_path)
  row = r['timing'][0]
  assert set(row['us_per_step']) == set(r['forms'])
  assert row['over_current']['current'] == 1.0
  assert set(r['checks'][0]['chi_square_p']) >= {'current', 'inv_cdf'}


def test_few_row_check(tmp_path):
  r = smoke('few_row_check', tmp_path)
  (shape,) = r['shapes'].values()
  assert shape['over_gemv1']['f32 gemv1'] == 1.0 and shape['gemv1_us'] > 0


def test_mla_decode_forms(tmp_path):
  (row,) = smoke('mla_decode_forms', tmp_path)['results']
  assert row['chosen'] in ('absorbed', 'two_step') and row['absorbed_us'] > 0


def test_attention_core(tmp_path):
  r = smoke('attention_core', tmp_path, '--variants', 'xla,blocked16,saved16')
  for name in ('blocked16', 'saved16'):  # the same function as the library call
    assert r['variants'][name]['max_abs_diff_vs_first'] < 1e-3


def test_host_malloc(tmp_path):
  r = smoke('host_malloc', tmp_path, '--configs', 'stdlib_mtp')
  assert [x['mode'] for x in r['rounds']['keep']] == ['keep']
  summary = r['summary']['stdlib_mtp']
  assert summary['first_equal'] is True  # the allocator changes no number
  assert summary['time_ratio_keep_vs_system_median'] > 0


def test_vs_maxtext(tmp_path, fake_peer):
  r = smoke('vs_maxtext', tmp_path, '--peer', fake_peer, '--peer_root', str(tmp_path / 'peer'))
  d0 = r['summary']['depths']['0']
  assert d0['maxtext_tokens_per_sec'] == [1000.0]
  assert d0['ratios'] == [round(d0['mtp_jax_tokens_per_sec'][0] / 1000.0, 3)]


def test_vs_maxtext_needs_the_peer(capsys):
  module = importlib.import_module('vs_maxtext')
  with pytest.raises(SystemExit) as e:
    module.parse([])
  assert e.value.code == 2
  assert capsys.readouterr().err.strip().startswith('error: --peer')


@pytest.mark.slow
def test_compare_mtp_targets(tmp_path, stdlib_data_dir):
  r = smoke('compare_mtp_targets', tmp_path, '--root', str(tmp_path / 'root'),
            '--data_dir', stdlib_data_dir)
  run = r['runs']['distilled']
  assert run['greedy_identical_to_ar'] is True and len(run['agree']) == 3


def test_every_script_has_a_smoke_test():
  tested = {n for n in SCRIPTS if f"smoke('{n}'" in pathlib.Path(__file__).read_text()}
  assert tested == set(SCRIPTS)


REQUIRED = {'decode_speed': ['--workdir', 'runs/x'], 'tree_decode': ['--workdir', 'runs/x'],
            'vs_maxtext': ['--peer', __file__]}


@pytest.mark.parametrize('name', SCRIPTS)
def test_default_output_is_not_a_committed_file(name):
  args = importlib.import_module(name).parse(REQUIRED.get(name, []))
  assert os.path.relpath(args.out, REPO).startswith(os.path.join('runs', 'benchmarks'))
  assert not common.committed(args.out)
  ignored = subprocess.run(['git', '-C', REPO, 'check-ignore', '-q', args.out], check=False)
  assert ignored.returncode == 0, f'{args.out} is not gitignored'


def test_committed_results_record_what_they_measured():
  paths = glob.glob(os.path.join(BENCH, 'results', '*.json'))
  assert paths
  for path in paths:
    text = pathlib.Path(path).read_text()
    doc = json.loads(text)
    assert doc['benchmark'] == os.path.basename(path)[:-5] and doc['smoke'] is False
    assert doc['machine']['cpu'] and doc['machine']['cores'] >= 1 and doc['note']
    for run in doc.get('runs', [doc]):
      assert run['commit'] and run['command'] and run['date'], path
      assert run['load_average']['start'] and run['load_average']['end'], path
    for root in ('work', 'tmp', 'root', 'home'):  # no absolute path of the measuring host
      assert f'/{root}/' not in text, (path, root)


def test_restart_time(tmp_path):
  r = smoke('restart_time', tmp_path)
  pair = r['rounds'][0]
  assert pair['first']['cache_entries'] > 0
  assert r['summary']['rerun_wrote_no_entry'] is True  # the rerun compiled nothing anew
  assert pair['rerun']['to_first_step_s'] > 0


def test_main_job(tmp_path, stdlib_data_dir):
  r = smoke('main_job', tmp_path, '--data_dir', stdlib_data_dir)
  assert r['step'] == 2 and 'eval/bpb_main' in r['figures']
  assert all(f['value'] is not None for f in r['figures'].values())


def test_main_job_table_is_readmes_and_a_rerun_is_held_to_the_spread():
  import main_job
  text = pathlib.Path(REPO, 'README.md').read_text(encoding='utf-8')
  table = [line for line in text.splitlines() if line.startswith('| bits per byte |')
           or line.startswith('| top-1 accuracy')]
  cells = [[c.strip() for c in line.strip('|').split('|')[1:]] for line in table]
  ref = main_job.HOSTS['AMD EPYC, AVX-512 (2 vCPU)']
  assert [float(c) for c in cells[0]] == [ref[f'eval/bpb_{d}'] for d in
                                          ('main', 'mtp_1', 'mtp_2', 'mtp_3')]
  assert float(cells[1][0]) == ref['eval/acc_main']
  for host in main_job.HOSTS.values():  # each host's own figures are within
    assert all(r['within'] for k, r in main_job.compare(host).items() if k in host)
  worse = dict(ref, **{'eval/bpb_main': ref['eval/bpb_main'] + 0.2})
  verdict = main_job.compare(worse)
  assert not verdict['eval/bpb_main']['within'] and verdict['eval/bpb_mtp_1']['within']
