"""Hugging Face trunks (mtp_jax/interop/hf.py): logits and greedy decoding equal transformers', the
checkpoint's tokenizer, frozen-trunk MTP training on it, and one-line errors on bad input."""
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file

from helpers import REPO, hf_tokenizer_texts, load_config
from mtp_jax import config_lib, train_state
from mtp_jax.config_lib import ConfigError
from mtp_jax.data import tokenizers
from mtp_jax.decode import Decoder
from mtp_jax.interop import export, hf, layouts
from mtp_jax.model import MTPModel, layers
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.runtime import sharding
from mtp_jax.train import train_and_evaluate

FAMILIES = ('llama', 'qwen2')
CODE = 'def f(x):\n\tif x:\n        return {"é": x}  # 日本語 🐍\n\n'
TEXTS = [CODE, '', ' ', '\n\n', 'trailing   ', 'crlf\r\nline\r\n', 'unicode: é → 日本語 🐍 \u00a0',
         '\ufffd \x0b\x0c \x1b[0m', 'class A:\n    pass\n'] + hf_tokenizer_texts()[:1]


def hf_config(directory, depth=1):
  c = config_lib.base_config()
  c.model.mtp.depth = depth
  c.data.seq_len = 64
  hf.apply_to_config(c, directory)
  return c


@pytest.fixture(scope='module')
def loaded(hf_models):
  """{family: (config, MTPModel with the checkpoint's trunk, transformers model, tokenizer)}."""
  out = {}
  for family, (directory, ref) in hf_models.items():
    c = hf_config(directory, depth=2)
    out[family] = (c, hf.load_model(directory, c), ref, tokenizers.get_tokenizer(c.data))
  return out


def ref_logits(ref, ids_BxT):
  with torch.no_grad():
    return ref(torch.tensor(np.asarray(ids_BxT), dtype=torch.long)).logits.numpy()


def ref_greedy(ref, prompt, n):
  ref.generation_config.eos_token_id = None  # decode exactly n tokens, as eos_id=None below
  with torch.no_grad():
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


# ----------------------------------------------------------------------------- the model
@pytest.mark.parametrize('family', FAMILIES)
def test_config_fields_follow_config_json(loaded, family):
  c = loaded[family][0]
  m = c.model
  assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.mlp_dim) == (
      64, 2, 4, 2, 16, 96)
  assert m.norm_eps == 1e-5 and m.max_positions == 128 and m.mtp.depth == 2
  if family == 'llama':
    assert m.vocab_size == 320 and not m.tie_embeddings and not m.attention_bias
    assert (m.rope_scaling.kind, m.rope_scaling.factor, m.rope_scaling.original_max_positions) == (
        'llama3', 8.0, 64)
  else:
    assert m.vocab_size == 304 and m.tie_embeddings and m.attention_bias
    assert (m.rope_scaling.kind, m.rope_scaling.factor, m.rope_theta) == ('linear', 2.0, 1000.0)
  assert c.data.tokenizer == 'hf'
  assert os.path.isfile(os.path.join(c.data.hf_tokenizer, 'tokenizer.json'))


@pytest.mark.parametrize('family', FAMILIES)
def test_logits_equal_transformers(loaded, family):
  _, model, ref, tok = loaded[family]
  rng = np.random.default_rng(0)
  code = tok.encode(CODE * 2)[:48]
  ids = np.stack([code, rng.integers(0, model.args.vocab_size, len(code))]).astype(np.int32)
  want = ref_logits(ref, ids)
  got = np.asarray(model.logits(model(jnp.asarray(ids))[0]))
  assert got.shape == want.shape == (2, 48, model.args.vocab_size)
  assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
  assert want.std() > 0.3  # logits that are far from uniform: the comparison has teeth


def test_auto_import_matches_transformers_where_auto_trains_in_bf16(hf_models, monkeypatch):
  """model.dtype left at 'auto' on a host where 'auto' trains in bfloat16 (an AMX host): an
  imported trunk resolves float32 and its logits match transformers' as on a float32
  host; asked for bfloat16 explicitly it computes in bfloat16 (and drifts)."""
  monkeypatch.setenv(peak_lib.AUTO_ENV, 'bfloat16')
  directory, ref = hf_models['llama']
  ids = np.arange(2 * 40, dtype=np.int32).reshape(2, 40) % 300
  want = ref_logits(ref, ids)
  errs = {}
  for dtype in ('auto', 'bfloat16'):
    c = hf_config(directory)
    c.model.dtype = dtype
    model = hf.load_model(directory, c)
    errs[dtype] = float(np.abs(np.asarray(model.logits(model(jnp.asarray(ids))[0])) - want).max())
    assert model.args.dtype == (jnp.float32 if dtype == 'auto' else jnp.bfloat16)
  assert errs['auto'] <= 1e-4 < errs['bfloat16'], errs


@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_decoding_equals_generate(loaded, family):
  """Plain autoregressive decoding (the decoder's KV-cache path) of two prompts of
  different lengths in one batch; speculative decoding is checked on the trained trunk."""
  _, model, ref, tok = loaded[family]
  prompts = [tok.encode(CODE)[:12], tok.encode('import os\nprint(')]
  ar = Decoder(model).generate(prompts, 24, num_drafts=0, eos_id=None)
  for prompt, got in zip(prompts, ar.tokens):
    want = ref_greedy(ref, prompt, 24)
    assert got.tolist() == want and len(set(want)) > 1


@pytest.mark.parametrize('family', FAMILIES)
def test_a_loaded_trunk_exports_as_its_own_family(loaded, family, tmp_path):
  """The llama layout writes an hf: trunk back as the class it came from (Qwen2 with its
  biases), with the checkpoint's tokenizer files: transformers loads it with the original's
  logits and tokens, and it reads back bit-exactly."""
  from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  c, model, ref, tok = loaded[family]
  out = tmp_path / 'export'
  export.export_model(model, str(out), 'llama', data_config=c.data)
  again = AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert type(again).__name__ == type(ref).__name__
  ids = np.asarray([tok.encode(CODE)[:24]], np.int32)
  np.testing.assert_array_equal(ref_logits(again, ids), ref_logits(ref, ids))
  # (the generic fast tokenizer, as in the tokenizer test below)
  assert PreTrainedTokenizerFast.from_pretrained(str(out))(CODE)['input_ids'] == tok.encode(CODE)
  back = config_lib.base_config()
  back.model.mtp.depth = 2
  hf.apply_to_config(back, str(out))
  reread = export.model_params(hf.load_model(str(out), back))
  for path, x in export.model_params(model).items():
    if path[0] != 'mtp':
      np.testing.assert_array_equal(reread[path], x, err_msg=str(path))


def test_rope_scaling_equals_transformers_at_llama_3_1_sizes():
  from transformers import LlamaConfig  # pylint: disable=g-import-not-at-top
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # pylint: disable=g-import-not-at-top
  for rope in ({'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192},
               {'rope_type': 'linear', 'factor': 4.0}):
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=rope, max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS[rope['rope_type']](cfg, 'cpu')
    c = config_lib.base_config()
    c.model.rope_theta, (c.model.rope_scaling.kind, c.model.rope_scaling.factor) = (
        500000.0, (rope['rope_type'], rope['factor']))
    c.model.rope_scaling.original_max_positions = 8192
    got = layers.rope_inv_freq(128, 500000.0, config_lib.rope_scaling_tuple(c))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    assert not np.allclose(got, layers.rope_inv_freq(128, 500000.0))


def test_sharded_load_equals_one_device(hf_models, loaded, devices):
  """hf.load_into onto the training shardings of a (data 2, fsdp 2, tensor 2) mesh: every
  device's block is read from the files on its own, and the result is the one-device load."""
  directory = hf_models['qwen2'][0]
  c, model = loaded['qwen2'][:2]
  c = c.copy_and_resolve_references()  # the module's shared config stays as it is
  c.mesh.shape = (2, 2, 2)
  mesh = sharding.make_mesh(c, devices)
  with sharding.use_mesh(mesh, sharding.rules_of(c)):
    abstract = nnx.state(nnx.eval_shape(lambda: MTPModel(model.args, rngs=nnx.Rngs(0))))
    shardings = dict(leaf_paths(sharding.state_shardings(abstract, mesh)))
  targets = {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[p])
             for p, x in leaf_paths(abstract)}
  got = hf.load_into(directory, model.args, targets)
  want = dict(leaf_paths(nnx.state(model)))
  split = 0
  for t in layouts.tensor_table(model.args, 'llama'):
    if t.path is None:  # the tied head: no parameter of its own
      continue
    arr = got[t.path]
    assert arr.sharding == shardings[t.path], t.name
    np.testing.assert_array_equal(np.asarray(arr), np.asarray(want[t.path]), err_msg=t.name)
    split += len({str(s.index) for s in arr.addressable_shards}) > 1
  assert len(got) == 26 and split == 26 - 5  # all but the final norm and the 4 layer norms


def leaf_paths(tree):
  """[(path without the 'value' leaf, leaf)] of an nnx State (or its shardings)."""
  return [(tuple(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in p)[:-1], x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


# ------------------------------------------------------------------------------ tokenizer
@pytest.mark.parametrize('family', FAMILIES)
def test_tokenizer_round_trips_code_and_unicode_with_the_checkpoints_ids(hf_models, loaded, family):
  # The generic fast tokenizer: AutoTokenizer would build transformers' Qwen2Tokenizer,
  # which swaps in Qwen's own pre-tokenizer regex (real Qwen files hold that regex anyway).
  from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top
  directory = hf_models[family][0]
  tok = loaded[family][3]
  assert tokenizers.roundtrip_failures(tok, TEXTS) == []
  ref = PreTrainedTokenizerFast.from_pretrained(directory)
  for text in TEXTS:
    assert tok.encode(text) == ref(text)['input_ids']  # the same ids and special tokens
  assert tok.eos_id == ref.eos_token_id and tok.eos_id not in (0, 1)
  assert tok.pad_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id)
  tb = tok.token_bytes()
  assert tb.shape == (tok.vocab_size,) and tb[tok.eos_id] == 1
  for text in TEXTS:  # the bytes of the ids sum to the text's, + 1 for the eos
    ids = tok.encode(text) + [tok.eos_id]
    assert int(tb[ids].sum()) == len(text.encode('utf-8')) + 1, text
  if family == 'llama':
    assert tok.encode('x')[0] == ref.bos_token_id and tb[ref.bos_token_id] == 0
  ids = tok.encode(CODE)
  assert tok.decode(ids + [tok.eos_id, tok.pad_id, tok.vocab_size + 5]) == CODE
  copy = pickle.loads(pickle.dumps(tok))
  assert copy.encode(CODE) == ids and copy.eos_id == tok.eos_id


def test_a_sentencepiece_only_directory_takes_its_tokenizer_model(hf_models, tmp_path):
  """No tokenizer.json but a tokenizer.model (Llama 2-style releases): the data tokenizer
  becomes that SentencePiece model with its own ids; its vocab must fit config.json's."""
  src = hf_models['llama'][0]
  d = tmp_path / 'spm_only'
  shutil.copytree(src, d)
  os.remove(d / 'tokenizer.json')
  proto = tokenizers.train_sentencepiece([CODE * 20, 'class A:\n    pass\n' * 20], vocab_size=295,
                                         num_threads=1)
  (d / 'tokenizer.model').write_bytes(proto)
  c = hf_config(str(d))
  assert c.data.tokenizer == 'sentencepiece' and c.data.spm_model == str(d / 'tokenizer.model')
  tok = tokenizers.get_tokenizer(c.data)
  ref = spm.SentencePieceProcessor(model_proto=proto)
  assert tok.encode(CODE) == ref.encode(CODE) and tok.decode(tok.encode(CODE)) == CODE
  assert tok.eos_id == ref.eos_id()
  cfg = json.loads((d / 'config.json').read_text())
  cfg['vocab_size'] = 100  # fewer ids than the model's 259+ (256 byte-fallback pieces)
  (d / 'config.json').write_text(json.dumps(cfg))
  with pytest.raises(ConfigError,
                     match=r'tokenizer.model has \d+ tokens but config.json vocab_size is 100'):
    hf_config(str(d))


# ------------------------------------------------------------ frozen-trunk MTP training
def torch_trunk(ref) -> dict:
  return {k: v.numpy() for k, v in ref.state_dict().items()}


def as_ours(t: layouts.Tensor, w: np.ndarray, args) -> np.ndarray:
  h = args.head_dim
  return {'copy': lambda: w, 'T': lambda: w.T,
          'in_heads': lambda: w.T.reshape(w.shape[1], -1, h),
          'out_heads': lambda: w.T.reshape(-1, h, w.shape[0]),
          'bias_heads': lambda: w.reshape(-1, h)}[t.kind]()


@pytest.mark.slow  # two short training runs, three decode programs: ~2 min on a loaded 2-core box
def test_frozen_mtp_training_keeps_the_hf_trunk_and_spec_decoding_is_lossless(
    hf_models, devices, stdlib_data_dir, tmp_path):
  """MTP modules trained on a frozen Llama trunk through train_and_evaluate(init_from=hf:DIR):
  every trunk tensor bit-identical to the checkpoint's, every MTP parameter moved, and
  speculative decoding with the trained modules gives AR's (and transformers') tokens."""
  directory, ref = hf_models['llama']
  c = load_config('tiny')
  c.data.data_dir = stdlib_data_dir
  c.data.seq_len, c.data.batch_size = 32, 4
  c.model.mtp.depth = 2
  c.model.mtp.freeze_trunk = True
  for k, v in dict(steps=3, checkpoint_every=3, warmup_steps=1, log_every=1, eval_every=0,
                   eval_batches=1, progress=False, lr=1e-2).items():
    c.train[k] = v
  workdir = tmp_path / 'run'
  init = f'hf:{directory}'
  train_and_evaluate(c, str(workdir), devices=devices[:1], init_from=init, stop_after=0)
  out = train_and_evaluate(c, str(workdir), devices=devices[:1], init_from=init)
  assert np.isfinite(out['train/loss']) and out['train/loss_mtp_2'] > 0
  assert c.model.d_model == 64 and c.data.tokenizer == 'hf'  # the checkpoint's model

  start = leaves_at(workdir, 0)
  end = leaves_at(workdir, 3)
  weights = torch_trunk(ref)
  args = hf.ModelArgs.from_config(tokenizers.resolve_vocab_size(c))
  table = layouts.tensor_table(args, 'llama')
  assert len(table) == 3 + 2 * 9
  for t in table:
    want = as_ours(t, weights[t.name], args)
    got = end[t.path]
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), t.name
  mtp = [p for p in end if p[0] == 'mtp']
  assert len(mtp) == 2 * 13 and set(end) == {t.path for t in table} | set(mtp)
  for p in mtp:
    assert not np.array_equal(end[p], start[p]), f'{p} did not train'

  model, step = train_state.restore_model_at(c, str(workdir), 3)
  assert step == 3
  tok = tokenizers.get_tokenizer(c.data)
  decoder = Decoder(model)
  prompts = [tok.encode(CODE)[:10], tok.encode('for i in range(')]
  ar = decoder.generate(prompts, 20, num_drafts=0, eos_id=None)
  spec = decoder.generate(prompts, 20, num_drafts=2, eos_id=None)
  assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in ar.tokens]
  assert ar.tokens[0].tolist() == ref_greedy(ref, prompts[0], 20)


def leaves_at(workdir, step) -> dict:
  """{parameter path without 'value'}: the model half of a checkpoint, read from disk."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with warnings.catch_warnings(), ocp.PyTreeCheckpointer() as ckpt:
    warnings.simplefilter('ignore')
    tree = ckpt.restore(os.path.join(str(workdir), 'checkpoints', str(step), 'state'))['0']
  return {p: np.asarray(x) for p, x in leaf_paths(tree)}


# ------------------------------------------------------------------------------- bad input
def _copy(hf_models, tmp_path, family='qwen2'):
  dst = tmp_path / f'bad_{family}'
  shutil.copytree(hf_models[family][0], dst)
  return dst


def _edit_json(path, **fields):
  cfg = json.loads(path.read_text())
  cfg.update(fields)
  path.write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
  tensors = load_file(str(path))
  fn(tensors)
  save_file(tensors, str(path))


def _bad_dir(kind, hf_models, tmp_path):
  """(a --init_from value, the words its error must hold)."""
  if kind == 'nonexistent':
    return f'hf:{tmp_path}/nowhere', r'nowhere: does not exist: give a local directory'
  if kind == 'a_file':
    (tmp_path / 'file').write_text('x')
    return f'hf:{tmp_path}/file', 'is not a directory'
  if kind == 'empty':
    return 'hf:', r'needs a local directory after hf:'
  d = _copy(hf_models, tmp_path, 'llama' if kind == 'hidden_size' else 'qwen2')
  st = d / 'model.safetensors'
  if kind == 'no_config':
    os.remove(d / 'config.json')
    return f'hf:{d}', 'no config.json in the directory'
  if kind == 'hidden_size':
    _edit_json(d / 'config.json', hidden_size=48)
    return f'hf:{d}', (r'tensor model.embed_tokens.weight has shape \[320, 64\] but config.json '
                       r'implies \[320, 48\] \(hidden_size 48')
  if kind == 'layers':
    _edit_json(d / 'config.json', num_hidden_layers=3)
    return f'hf:{d}', 'tensor model.layers.2.input_layernorm.weight is missing'
  if kind == 'qwen3':
    _edit_json(d / 'config.json', architectures=['Qwen3ForCausalLM'])
    return f'hf:{d}', (r"architectures 'Qwen3ForCausalLM' is not supported \(Qwen3 has q/k "
                       r"norms.*\); supported: LlamaForCausalLM, .*DeepseekV3ForCausalLM")
  if kind == 'unknown_arch':
    _edit_json(d / 'config.json', architectures=['FancyNewForCausalLM'])
    return f'hf:{d}', r"architectures 'FancyNewForCausalLM' is not supported \(unknown"
  if kind == 'rope_type':
    _edit_json(d / 'config.json', rope_parameters={'rope_type': 'yarn', 'factor': 4.0,
                                                   'rope_theta': 1e4})
    return f'hf:{d}', r"rope_parameters.rope_type 'yarn' is not supported"
  if kind == 'missing_tensor':
    _edit_tensors(st, lambda t: t.pop('model.layers.1.mlp.up_proj.weight'))
    return f'hf:{d}', 'tensor model.layers.1.mlp.up_proj.weight is missing'
  if kind == 'wrong_shape':
    _edit_tensors(st, lambda t: t.update({'model.layers.0.self_attn.k_proj.bias':
                                          np.zeros([16], np.float32)}))
    return f'hf:{d}', (r'tensor model.layers.0.self_attn.k_proj.bias has shape \[16\] but '
                       r'config.json implies \[32\]')
  if kind == 'extra_tensor':
    _edit_tensors(st, lambda t: t.update({'model.layers.0.self_attn.q_norm.weight':
                                          np.ones([16], np.float32)}))
    return f'hf:{d}', 'unexpected tensor model.layers.0.self_attn.q_norm.weight'
  if kind == 'truncated':  # header intact, data cut
    st.write_bytes(st.read_bytes()[:-64])
    return f'hf:{d}', ('model.safetensors is not a readable safetensors file: truncated: its '
                       'header names more bytes than the file holds')
  if kind == 'no_tokenizer':
    os.remove(d / 'tokenizer.json')
    return f'hf:{d}', r'data.hf_tokenizer .* has no tokenizer.json'
  raise AssertionError(kind)


BAD = ('nonexistent', 'a_file', 'empty', 'no_config', 'hidden_size', 'layers', 'qwen3',
       'unknown_arch', 'rope_type', 'missing_tensor', 'wrong_shape', 'extra_tensor',
       'truncated', 'no_tokenizer')


@pytest.mark.parametrize('kind', BAD)
def test_bad_hf_directories_are_one_line_errors_before_compiling(kind, hf_models, devices,
                                                                 stdlib_data_dir, tmp_path,
                                                                 monkeypatch):
  init, words = _bad_dir(kind, hf_models, tmp_path)
  c = load_config('tiny')
  c.data.data_dir = stdlib_data_dir
  c.model.mtp.freeze_trunk = True
  compiled = []
  monkeypatch.setattr(train_state, 'init_state', lambda *a, **k: compiled.append(1))
  with pytest.raises(ConfigError, match=words) as e:
    train_and_evaluate(c, str(tmp_path / 'run'), devices=devices[:1], init_from=init)
  assert '\n' not in str(e.value) and not compiled
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_the_cli_exits_2_with_one_line(hf_models, stdlib_data_dir, tmp_path):
  init, words = _bad_dir('wrong_shape', hf_models, tmp_path)
  env = dict(os.environ, XLA_FLAGS='', JAX_PLATFORMS='cpu')
  r = subprocess.run([sys.executable, os.path.join(REPO, 'scripts', 'train.py'),
                      '--config', os.path.join(REPO, 'configs', 'tiny.py'),
                      '--workdir', str(tmp_path / 'run'), f'--init_from={init}',
                      '--config.model.mtp.freeze_trunk=True',
                      f'--config.data.data_dir={stdlib_data_dir}'],
                     capture_output=True, text=True, env=env, timeout=300, check=False)
  assert r.returncode == 2, r.stderr[-2000:]
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: --init_from hf:'), r.stderr
  assert 'model.layers.0.self_attn.k_proj.bias has shape [16]' in lines[0]


@pytest.mark.parametrize('fields, words', [
    ({'model.rope_scaling.kind': 'yarn'}, 'model.rope_scaling.kind'),
    ({'model.rope_scaling.kind': 'linear', 'model.rope_scaling.factor': 0.0},
     'model.rope_scaling.factor'),
    ({'model.rope_scaling.kind': 'llama3', 'model.rope_scaling.low_freq_factor': 4.0},
     'low_freq_factor < high_freq_factor'),
    ({'model.rope_scaling.kind': 'linear', 'model.attention': 'mla'},
     'model.rope_scaling applies to GQA attention only'),
    ({'model.max_positions': 8}, r'data.seq_len \(256\) exceeds model.max_positions \(8\)'),
    ({'data.tokenizer': 'hf'}, 'data.hf_tokenizer must name a directory'),
])
def test_new_config_fields_are_validated(fields, words):
  c = load_config('tiny')
  c.data.seq_len = 256
  for field, value in fields.items():
    node = c
    for part in field.split('.')[:-1]:
      node = node[part]
    node[field.split('.')[-1]] = value
  with pytest.raises(ConfigError, match=words):
    config_lib.validate(c)


def test_vocab_must_divide_over_its_mesh_axes():
  c = load_config('tiny')
  c.model.vocab_size = 303
  c.mesh.shape = (4, 1, 2)
  with pytest.raises(ConfigError, match=r'model.vocab_size \(303\) must be divisible'):
    config_lib.validate(c, 8)
  c.model.vocab_size = 304
  config_lib.validate(c, 8)
