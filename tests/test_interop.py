"""Exports that load where users load them, and read back through `--init_from hf:`.

For each layout the exporter writes (a Llama trunk, DeepSeek-V3 with MTP layers, float32
and FP8, MiMo): workdir -> export -> a run started with `--init_from hf:DIR` -> export
again gives the same files; transformers' AutoModelForCausalLM / AutoTokenizer load the
export and decode greedily what this project's decoder decodes.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from helpers import REPO, dsv3_model_config, load_config, tiny_model_config, write_workdir
from mtp_jax import train_state
from mtp_jax.checkpoint import resolve_checkpoint
from mtp_jax.data import tokenizers
from mtp_jax.decode import Decoder
from mtp_jax.interop import export, hf
from mtp_jax.interop.safetensors_io import Reader
from mtp_jax.model import ModelArgs, MTPModel
from mtp_jax.train import train_and_evaluate
from mtp_jax.train_state import InitFrom

CASES = ('llama', 'mimo', 'deepseek_v3', 'deepseek_v3_fp8')
TEXTS = ['def f(x):\n\treturn {"é": x}  # 日本語 🐍\n', '', ' \n', 'a<b>c</s>\x00\xff']


def _model_config(case):
  """A tiny model of the case's kind over the byte tokenizer (vocab 258 -> 320)."""
  if case == 'llama':  # untied, Llama 3.1 RoPE scaling: LlamaForCausalLM
    c = tiny_model_config(1, tie_embeddings=False)
    c.model.rope_scaling.kind, c.model.rope_scaling.factor = 'llama3', 4.0
    c.model.rope_scaling.original_max_positions = 16
  elif case == 'mimo':  # real q/k/v biases (a Qwen2 trunk), tied
    c = tiny_model_config(2, attention_bias=True)
  else:  # MLA + MoE, two MTP layers
    c = dsv3_model_config(2)
  c.model.vocab_size = 320
  return c


def _files(directory) -> dict:
  """{tensor name: (dtype, bytes)} of an export."""
  with Reader(str(directory)) as r:
    return {n: (r.dtype(n), r.get(n).tobytes()) for n in r.keys()}


def _json(directory, name):
  with open(os.path.join(str(directory), name)) as f:
    return json.load(f)


def _train_config(data_dir):
  c = load_config('tiny')
  c.data.data_dir = data_dir
  c.data.seq_len, c.data.batch_size = 16, 4
  for k, v in dict(steps=2, checkpoint_every=2, warmup_steps=1, log_every=1, eval_every=0,
                   eval_batches=1, progress=False).items():
    c.train[k] = v
  return c


@pytest.fixture(scope='module')
def exports(tmp_path_factory):
  """{case: (model, its export directory)}: a workdir's checkpoint exported once."""
  out = {}
  for case in CASES:
    base = tmp_path_factory.mktemp(case)
    model = write_workdir(str(base / 'run'), _model_config(case), seed=len(case))
    layout = case.replace('_fp8', '')
    export.export_workdir(str(base / 'run'), str(base / 'hf'), layout, fp8=case.endswith('fp8'))
    out[case] = (model, base / 'hf')
  return out


@pytest.mark.parametrize('case', CASES)
def test_export_init_from_hf_export_again_is_the_same(case, exports, devices, stdlib_data_dir,
                                                      tmp_path):
  """A run started from the export holds exactly the export's weights (FP8 as dequantised)
  and its MTP layers; exporting that run writes the same tensors and config.json."""
  model, first = exports[case]
  layout = case.replace('_fp8', '')
  c = _train_config(stdlib_data_dir)
  run = str(tmp_path / 'run')
  train_and_evaluate(c, run, devices=devices[:1], init_from=f'hf:{first}', stop_after=0)
  assert c.data.tokenizer == 'hf' and c.model.d_model == 32  # the export's model, its tokenizer
  again = tmp_path / 'again'
  export.export_workdir(run, str(again), layout, fp8=case.endswith('fp8'))
  a, b = _files(first), _files(again)
  assert sorted(a) == sorted(b)
  assert [n for n in a if a[n] != b[n]] == []  # FP8: the same blocks and scales, too
  assert _json(first, 'config.json') == _json(again, 'config.json')
  assert _json(first, 'generation_config.json') == {'eos_token_id': 1, 'pad_token_id': 0}
  loaded, _ = train_state.restore_model_at(c, run, 0)
  got = export.model_params(loaded)
  # What the files hold (FP8 dequantised; test_hf_layouts bounds its error), else the model.
  want = export.model_params(hf.load_dir(str(first))[1] if case.endswith('fp8') else model)
  depths = 0 if layout == 'llama' else c.model.mtp.depth
  compared = 0
  for path, x in want.items():
    if path[0] == 'mtp' and int(path[1]) >= depths:
      continue  # the llama layout has no MTP names: those depths start fresh
    np.testing.assert_array_equal(got[path], x, err_msg=str(path))
    compared += path[0] == 'mtp'
  assert compared == (0 if layout == 'llama' else 2 * len(
      [p for p in want if p[:2] == ('mtp', '0')]))


@pytest.mark.parametrize('case', CASES)
def test_params_from_tensors_in_memory_equal_the_directory_read(case, exports):
  """params_from_hf on the export's tensors held in a dict gives the exported model's
  parameters (FP8: what the directory's tensor-by-tensor reader dequantises), with every
  MTP layer the export declares."""
  model, directory = exports[case]
  with Reader(str(directory)) as r:
    tensors = {n: r.get(n) for n in r.keys()}
  got = hf.params_from_hf(tensors, _json(directory, 'config.json'))
  if case.endswith('fp8'):  # the sharded reader of --init_from hf:, not params_from_hf
    c = load_config('tiny')
    c.model.mtp.depth = 2
    hf.apply_to_config(c, str(directory))
    want = export.model_params(hf.load_model(str(directory), c))
  else:
    want = export.model_params(model)
  if case == 'llama':  # the llama layout has no MTP names: a plain causal LM
    want = {p: x for p, x in want.items() if p[0] != 'mtp'}
  assert sorted(got) == sorted(want) and any(p[0] == 'mtp' for p in got) == (case != 'llama')
  for path, x in want.items():
    assert got[path].dtype == np.float32
    np.testing.assert_array_equal(got[path], x, err_msg=str(path))


def test_params_from_tensors_in_memory_check_like_a_directory(exports):
  _, directory = exports['mimo']
  with Reader(str(directory)) as r:
    tensors = {n: r.get(n) for n in r.keys()}
  cfg = _json(directory, 'config.json')
  name = 'model.layers.0.self_attn.q_proj.weight'
  missing = {n: x for n, x in tensors.items() if n != name}
  with pytest.raises(hf.InteropError, match=f'^tensors: tensor {name} is missing') as e:
    hf.params_from_hf(missing, cfg)
  assert '\n' not in str(e.value)
  wrong = dict(tensors, **{name: tensors[name][:-1]})
  with pytest.raises(hf.InteropError, match=f'tensor {name} has shape'):
    hf.params_from_hf(wrong, cfg, where='my weights')
  ints = dict(tensors, **{name: tensors[name].astype(np.int32)})
  with pytest.raises(hf.InteropError, match='has dtype int32; only F32'):
    hf.params_from_hf(ints, cfg)


def _greedy(ref, prompt, n):
  import torch  # pylint: disable=g-import-not-at-top
  ref.generation_config.eos_token_id = None  # exactly n tokens, as eos_id=None below
  with torch.no_grad():
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


@pytest.mark.parametrize('case', ['llama', 'mimo', 'deepseek_v3'])
def test_auto_model_loads_each_export_and_decodes_the_same(case, exports):
  """AutoModelForCausalLM builds the trunk from config.json alone (the MTP layers are names
  it skips) and decodes greedily what the project's decoder does; AutoTokenizer gives the
  byte tokenizer's ids."""
  transformers = pytest.importorskip('transformers')
  model, directory = exports[case]
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
  want_class = {'llama': 'LlamaForCausalLM', 'mimo': 'Qwen2ForCausalLM',
                'deepseek_v3': 'DeepseekV3ForCausalLM'}[case]
  assert type(ref).__name__ == want_class
  tok = transformers.AutoTokenizer.from_pretrained(str(directory))
  ours = tokenizers.ByteTokenizer()
  for text in TEXTS:
    assert tok(text)['input_ids'] == ours.encode(text), text
    assert tok.decode(ours.encode(text) + [1], skip_special_tokens=True) == text
  assert (tok.eos_token_id, tok.pad_token_id) == (1, 0)
  prompt = ours.encode('def f(x):')
  got = Decoder(model).generate([prompt], 16, num_drafts=0, eos_id=None).tokens[0].tolist()
  want = _greedy(ref, prompt, 16)
  assert got == want and len(set(want)) > 1


def test_auto_model_reads_the_fp8_export(exports):
  """transformers dequantises the FP8 export on a CPU (with accelerate, a test dependency) and
  decodes greedily what this project does from the same blocks."""
  transformers = pytest.importorskip('transformers')
  _, directory = exports['deepseek_v3_fp8']
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
  assert type(ref).__name__ == 'DeepseekV3ForCausalLM'
  _, model = hf.load_dir(str(directory))  # the same FP8 blocks, dequantised by this project
  prompt = tokenizers.ByteTokenizer().encode('def f(x):')
  got = Decoder(model).generate([prompt], 16, num_drafts=0, eos_id=None).tokens[0].tolist()
  want = _greedy(ref, prompt, 16)
  assert got == want and len(set(want)) > 1


def test_byte_tokenizer_export_reproduces_the_id_offset(exports):
  """The exported tokenizer.json, read by this project's HF tokenizer, is the byte
  tokenizer: the same ids, bytes per id (bits per byte) and text."""
  _, directory = exports['llama']
  tok = tokenizers.HFTokenizer.from_dir(str(directory))
  ours = tokenizers.ByteTokenizer()
  assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (258, 1, 0)
  np.testing.assert_array_equal(tok.token_bytes(), ours.token_bytes())
  for text in TEXTS:
    ids = ours.encode(text)
    assert tok.encode(text) == ids and tok.decode(ids + [1, 0]) == text


def test_sentencepiece_tokenizer_exports_as_tokenizer_model(tmp_path):
  """A SentencePiece-trained run exports its model as tokenizer.model: AutoTokenizer and
  `--init_from hf:` (which takes tokenizer.model when there is no tokenizer.json) give its
  ids."""
  transformers = pytest.importorskip('transformers')
  spm_path = tmp_path / 'code.model'  # 256 byte-fallback pieces + the characters + merges
  spm_path.write_bytes(tokenizers.train_sentencepiece([pathlib.Path(json.__file__).read_text()] * 4,
                                                      vocab_size=360, num_threads=1))
  c = _model_config('llama')
  c.model.vocab_size = 384
  model = MTPModel(ModelArgs.from_config(c), rngs=nnx.Rngs(0))
  c.data.tokenizer, c.data.spm_model = 'sentencepiece', str(spm_path)
  out = tmp_path / 'spm_export'
  export.export_model(model, str(out), 'llama', data_config=c.data)
  ours = tokenizers.get_tokenizer(c.data)
  theirs = transformers.AutoTokenizer.from_pretrained(str(out))
  back = load_config('tiny')
  hf.apply_to_config(back, str(out))
  assert back.data.tokenizer == 'sentencepiece'
  again = tokenizers.get_tokenizer(back.data)
  for text in TEXTS[:3]:
    assert theirs(text)['input_ids'] == ours.encode(text) == again.encode(text), text
  assert _json(out, 'generation_config.json') == {'eos_token_id': ours.eos_id,
                                                  'pad_token_id': ours.pad_id}


def test_unsupported_architecture_is_one_line_naming_the_supported(exports, tmp_path):
  _, directory = exports['mimo']
  d = tmp_path / 'gemma'
  d.mkdir()
  for name in os.listdir(directory):
    (d / name).write_bytes((directory / name).read_bytes())
  cfg = _json(d, 'config.json')
  cfg['architectures'] = ['GemmaForCausalLM']
  (d / 'config.json').write_text(json.dumps(cfg))
  c = load_config('tiny')
  with pytest.raises(hf.InteropError) as e:
    hf.apply_to_config(c, str(d))
  assert '\n' not in str(e.value) and str(e.value).endswith(
      'supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, '
      'DeepseekV3ForCausalLM, MiMoForCausalLM')


@pytest.mark.slow  # two command lines (~1 min on 2 loaded cores); the round trip above is fast
def test_command_line_trains_the_mtp_modules_of_a_deepseek_v3_export(stdlib_data_dir, tmp_path):
  """scripts/export.py writes a DeepSeek-V3 FP8 export (MLA, MoE, two MTP layers);
  scripts/train.py starts from it with `--init_from hf:DIR`, its MTP layers loaded, and
  trains (MoE trunks train jointly: freeze_trunk refuses MoE routing biases)."""
  run = str(tmp_path / 'run')
  write_workdir(run, _model_config('deepseek_v3'), seed=4)
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  out = str(tmp_path / 'v3')
  r = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'export.py'),
                      '--workdir', run, '--out', out, '--layout', 'deepseek_v3', '--fp8'],
                     capture_output=True, text=True, env=env, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert 'as deepseek_v3' in r.stdout and '(FP8)' in r.stdout
  r = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
                      '--config', os.path.join(REPO, 'configs', 'tiny.py'),
                      '--workdir', str(tmp_path / 'mtp'), f'--init_from=hf:{out}',
                      '--config.train.steps=2',
                      '--config.train.eval_every=0', '--config.train.eval_batches=1',
                      '--config.train.progress=False', '--config.data.seq_len=16',
                      '--config.data.batch_size=4', f'--config.data.data_dir={stdlib_data_dir}'],
                     capture_output=True, text=True, env=env, timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'MTP depth(s) 1..2 loaded from its MTP layers' in r.stderr + r.stdout
  lines = (tmp_path / 'mtp' / 'metrics.jsonl').read_text().splitlines()
  metrics = [json.loads(line) for line in lines]
  last = [m for m in metrics if 'train/loss_mtp_2' in m][-1]
  assert last['train/loss_mtp_2'] > 0


def test_init_from_is_parsed_once_into_a_typed_value(tmp_path):
  assert InitFrom.parse(None) is None and InitFrom.parse('  ') is None
  got = InitFrom.parse(f'hf:{tmp_path}/x/../model')
  assert (got.kind, got.path, str(got)) == ('hf', f'{tmp_path}/model', f'hf:{tmp_path}/model')
  assert InitFrom.parse('hf:') == InitFrom('hf', '')
  assert InitFrom.parse(got) is got
  (tmp_path / 'run' / 'checkpoints' / '40' / 'state').mkdir(parents=True)
  step_dir = str(tmp_path / 'run' / 'checkpoints' / '40')
  assert InitFrom.parse(step_dir) == InitFrom('checkpoint', step_dir)
  assert InitFrom.parse(str(tmp_path / 'run')) == InitFrom('checkpoint', str(tmp_path / 'run'))
  # the one parse of a checkpoint path: a step directory names its step, a workdir none
  assert resolve_checkpoint(step_dir) == (str(tmp_path / 'run' / 'checkpoints'), 40)
  assert resolve_checkpoint(str(tmp_path / 'run')) == (
      str(tmp_path / 'run' / 'checkpoints'), None)
