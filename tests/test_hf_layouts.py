"""Hugging Face-layout import / export of the MTP layouts (mtp_jax/interop/, mtp-export).

DeepSeek-V3's layout is checked against its published names (README_WEIGHTS.md and
inference/convert.py of github.com/deepseek-ai/DeepSeek-V3, and the tensor listing of the
release's model.safetensors.index.json), MiMo's against the loaders that read it (vLLM's
vllm/model_executor/models/mimo_mtp.py, SGLang's python/sglang/srt/models/mimo_mtp.py),
and the RoPE row order against transformers' own DeepseekV3 forward.
"""
import dataclasses
import glob
import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from helpers import (
  dsv3_model_config,
  params_with_routing_bias,
  randomize,
  tiny_model_config,
  write_workdir,
)
from mtp_jax.commands import export as export_cmd
from mtp_jax.data import tokenizers
from mtp_jax.interop import export, fp8, hf, hf_config, layouts
from mtp_jax.interop.safetensors_io import INDEX, InteropError, Reader, read_json, write_dir
from mtp_jax.model import ModelArgs, MTPModel, layers

TOKENS = np.arange(12, dtype=np.int32)[None] * 5 % 64


def _model(config, seed=0):
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(config))
  model = MTPModel(args, rngs=nnx.Rngs(seed))
  if args.mlp == 'moe':
    params_with_routing_bias(model, seed + 5)
  else:
    randomize(model, seed + 1)
  return args, model


@nnx.jit
def _logits(model, tokens):
  return [model.logits(h, k) for k, h in enumerate(model(tokens))]


class _Dir:
  """A written directory: its config.json and its tensors by name, as stored."""

  def __init__(self, directory):
    self.config = read_json(os.path.join(directory, 'config.json'), directory)
    self.reader = Reader(directory)

  def keys(self):
    return self.reader.keys()

  def __getitem__(self, name):
    return self.reader.get(name)

  def dtype(self, name):
    return self.reader.dtype(name)


def _write(directory, tensors, config) -> str:
  """A Hugging Face-layout directory of these tensors and config.json."""
  write_dir(str(directory), tensors)
  with open(os.path.join(str(directory), 'config.json'), 'w') as f:
    json.dump(config, f)
  return str(directory)


def _read_back(directory, tensors, config) -> dict:
  """model_params of what hf.load_dir reads from these tensors and config.json."""
  return export.model_params(hf.load_dir(_write(directory, tensors, config))[1])


def _assert_same_tree(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


# -- DeepSeek-V3's published names ------------------------------------------------------------
# README_WEIGHTS.md: model.embed_tokens.weight, model.layers.0 .. num_hidden_layers - 1,
# model.norm.weight, lm_head.weight; MTP module k at layer num_hidden_layers + k - 1 with
# embed_tokens, enorm, hnorm, eh_proj, shared_head (norm + head) and a hidden layer's
# self_attn & mlp; FP8 weights carry a float32 weight_scale_inv per 128 x 128 block. Leaf
# names: the keys of inference/convert.py's `mapping` (q_a_proj, q_a_layernorm, q_b_proj or
# q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, gate, gate_proj, up_proj,
# down_proj, input_layernorm, post_attention_layernorm, norm, embed_tokens, lm_head) plus
# e_score_correction_bias, experts.{j} and shared_experts. Which tensors are FP8 and the
# wide types of the rest: the release's listing (float8_e4m3fn: every projection of the
# decoder layers; float32: weight_scale_inv, e_score_correction_bias; bfloat16: the rest,
# incl. mlp.gate.weight, eh_proj, the embedding and both heads).
def published_tensors(c: dict) -> dict:
  """{name: (torch shape, release dtype)} of a DeepSeek-V3 checkpoint with config c."""
  d, n, v = c['hidden_size'], c['num_attention_heads'], c['vocab_size']
  qr, kvr = c['q_lora_rank'], c['kv_lora_rank']
  dn, dr, dv = c['qk_nope_head_dim'], c['qk_rope_head_dim'], c['v_head_dim']
  e, f, shared = c['n_routed_experts'], c['moe_intermediate_size'], c['n_shared_experts']
  out = {'model.embed_tokens.weight': ((v, d), 'BF16'), 'model.norm.weight': ((d,), 'BF16'),
         'lm_head.weight': ((v, d), 'BF16')}

  def proj(name, o, i):
    out[name] = ((o, i), 'F8_E4M3')
    out[f'{name}_scale_inv'] = ((-(-o // 128), -(-i // 128)), 'F32')

  def swiglu(pre, width):
    proj(f'{pre}.gate_proj.weight', width, d)
    proj(f'{pre}.up_proj.weight', width, d)
    proj(f'{pre}.down_proj.weight', d, width)

  n_layers, depth = c['num_hidden_layers'], c['num_nextn_predict_layers']
  for i in range(n_layers + depth):
    pre = f'model.layers.{i}'
    for norm in ('input_layernorm', 'post_attention_layernorm'):
      out[f'{pre}.{norm}.weight'] = ((d,), 'BF16')
    if qr:
      proj(f'{pre}.self_attn.q_a_proj.weight', qr, d)
      out[f'{pre}.self_attn.q_a_layernorm.weight'] = ((qr,), 'BF16')
      proj(f'{pre}.self_attn.q_b_proj.weight', n * (dn + dr), qr)
    else:
      proj(f'{pre}.self_attn.q_proj.weight', n * (dn + dr), d)
    proj(f'{pre}.self_attn.kv_a_proj_with_mqa.weight', kvr + dr, d)
    out[f'{pre}.self_attn.kv_a_layernorm.weight'] = ((kvr,), 'BF16')
    proj(f'{pre}.self_attn.kv_b_proj.weight', n * (dn + dv), kvr)
    proj(f'{pre}.self_attn.o_proj.weight', d, n * dv)
    if i < c['first_k_dense_replace']:
      swiglu(f'{pre}.mlp', c['intermediate_size'])
    else:
      out[f'{pre}.mlp.gate.weight'] = ((e, d), 'BF16')
      out[f'{pre}.mlp.gate.e_score_correction_bias'] = ((e,), 'F32')
      for j in range(e):
        swiglu(f'{pre}.mlp.experts.{j}', f)
      swiglu(f'{pre}.mlp.shared_experts', f * shared)
    if i >= n_layers:
      for name, shape in (('embed_tokens', (v, d)), ('enorm', (d,)), ('hnorm', (d,)),
                          ('eh_proj', (d, 2 * d)), ('shared_head.norm', (d,)),
                          ('shared_head.head', (v, d))):
        out[f'{pre}.{name}.weight'] = (shape, 'BF16')
  return out


# Entries of the release's listing (DeepSeek-V3 / R1: 61 layers + MTP layer 61, 256 experts).
RELEASE_ROWS = {
    'model.layers.0.mlp.down_proj.weight_scale_inv': ((56, 144), 'F32'),
    'model.layers.5.self_attn.kv_a_proj_with_mqa.weight': ((576, 7168), 'F8_E4M3'),
    'model.layers.5.self_attn.kv_a_proj_with_mqa.weight_scale_inv': ((5, 56), 'F32'),
    'model.layers.5.self_attn.kv_b_proj.weight': ((32768, 512), 'F8_E4M3'),
    'model.layers.5.self_attn.q_b_proj.weight_scale_inv': ((192, 12), 'F32'),
    'model.layers.5.self_attn.o_proj.weight': ((7168, 16384), 'F8_E4M3'),
    'model.layers.61.mlp.experts.255.down_proj.weight_scale_inv': ((56, 16), 'F32'),
    'model.layers.3.mlp.gate.weight': ((256, 7168), 'BF16'),
    'model.layers.3.mlp.gate.e_score_correction_bias': ((256,), 'F32'),
    'model.layers.61.eh_proj.weight': ((7168, 14336), 'BF16'),
    'model.layers.61.shared_head.head.weight': ((129280, 7168), 'BF16'),
}
V3_CONFIG = {'hidden_size': 7168, 'num_attention_heads': 128, 'vocab_size': 129280,
             'q_lora_rank': 1536, 'kv_lora_rank': 512, 'qk_nope_head_dim': 128,
             'qk_rope_head_dim': 64, 'v_head_dim': 128, 'n_routed_experts': 256,
             'moe_intermediate_size': 2048, 'n_shared_experts': 1, 'num_hidden_layers': 61,
             'num_nextn_predict_layers': 1, 'first_k_dense_replace': 3,
             'intermediate_size': 18432}


def test_published_name_list_reproduces_the_release():
  """The expected-name function, given DeepSeek-V3's own config, gives the release's shapes,
  dtypes and tensor count (91,991 in its index)."""
  names = published_tensors(V3_CONFIG)
  assert len(names) == 91991
  for name, row in RELEASE_ROWS.items():
    assert names[name] == row, name


# -- RoPE ---------------------------------------------------------------------------------
def test_rope_rows_permute_between_pair_and_half_order():
  """DeepSeek's rotary dims in pair order (complex multiplication, inference/model.py's
  apply_rotary_emb) equal layers.apply_rope on the rows convert puts in rotate-half order."""
  rng = np.random.default_rng(0)
  dr, t = 8, 5
  x_pairs = rng.normal(size=(1, t, 2, dr)).astype(np.float32)
  freqs = 1.0 / (10000.0 ** (np.arange(0, dr, 2) / dr))
  angle = np.arange(t)[:, None] * freqs
  z = (x_pairs[..., 0::2] + 1j * x_pairs[..., 1::2]) * np.exp(1j * angle)[None, :, None]
  rotated_pairs = np.stack([z.real, z.imag], -1).reshape(x_pairs.shape)
  pos = jnp.arange(t)[None]
  got = layers.apply_rope(jnp.asarray(layouts.rope_to_half(x_pairs, 0)), pos, 10000.0)
  np.testing.assert_allclose(np.asarray(got), layouts.rope_to_half(rotated_pairs, 0),
                             rtol=1e-5, atol=1e-5)
  w = rng.normal(size=(3, 4, 6 + dr))  # [in, heads, nope + rope]: only the rope tail moves
  moved = layouts.rope_to_pairs(w, 6)
  np.testing.assert_array_equal(moved[..., :6], w[..., :6])
  assert not np.array_equal(moved, w)
  np.testing.assert_array_equal(layouts.rope_to_half(moved, 6), w)


# -- DeepSeek-V3 layout ---------------------------------------------------------------------
@pytest.fixture(scope='module')
def dsv3(tmp_path_factory):
  """A random MLA + MoE model with M = 2 (routing biases random), and its FP8 export."""
  args, model = _model(dsv3_model_config(2))
  out = str(tmp_path_factory.mktemp('dsv3') / 'fp8')
  export.export_model(model, out, 'deepseek_v3', fp8=True)
  return args, model, out


def test_deepseek_v3_names_dtypes_and_shapes_are_the_published_ones(dsv3):
  args, _, out = dsv3
  ckpt = _Dir(out)
  want = published_tensors(ckpt.config)
  assert sorted(ckpt.keys()) == sorted(want)
  wide = {'BF16', 'F32'}  # this export keeps the wide tensors float32, as trained
  for name, (shape, dtype) in want.items():
    got = ckpt[name]
    assert tuple(got.shape) == shape, name
    assert ckpt.dtype(name) == dtype or (dtype in wide and ckpt.dtype(name) == 'F32'), name
  assert ckpt.config['num_nextn_predict_layers'] == 2
  assert ckpt.config['quantization_config']['weight_block_size'] == [128, 128]
  # DeepSeek's inference/convert.py: every key of layers < N names a leaf of its mapping.
  leaves = {'embed_tokens', 'input_layernorm', 'post_attention_layernorm', 'q_proj', 'q_a_proj',
            'q_a_layernorm', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_a_layernorm', 'kv_b_proj',
            'o_proj', 'gate', 'gate_proj', 'down_proj', 'up_proj', 'norm', 'lm_head', 'scale'}
  for name in ckpt.keys():
    if int((re.match(r'model\.layers\.(\d+)\.', name) or [0, -1])[1]) >= args.n_layers:
      continue
    short = name.replace('weight_scale_inv', 'scale').replace('e_score_correction_bias', 'bias')
    assert short.split('.')[-2] in leaves, name
  # vLLM's deepseek_mtp.py: an MTP layer's own names, the rest go to its mtp_block.
  n = args.n_layers
  own = {f'model.layers.{n}.{x}.weight' for x in
         ('embed_tokens', 'enorm', 'hnorm', 'eh_proj', 'shared_head.norm', 'shared_head.head')}
  assert own <= set(ckpt.keys())


def test_fp8_export_loads_as_its_dequantised_weights(dsv3):
  """Loading dequantises each FP8 weight block by its scale; the rest is bit-exact."""
  args, model, out = dsv3
  ckpt = _Dir(out)
  _, loaded = hf.load_dir(out)
  again = export.to_hf_tensors(export.model_params(loaded), args, 'deepseek_v3')
  exact = export.to_hf_tensors(export.model_params(model), args, 'deepseek_v3')
  assert sorted(again) == sorted(n for n in ckpt.keys() if not n.endswith('_scale_inv'))
  for name, x in again.items():
    if ckpt.dtype(name) == 'F8_E4M3':
      np.testing.assert_array_equal(
          x, fp8.dequantize(ckpt[name], ckpt[f'{name}_scale_inv']))
      scale = np.repeat(np.repeat(ckpt[f'{name}_scale_inv'], 128, 0), 128, 1)
      err = np.abs(x - exact[name]) / scale[:x.shape[0], :x.shape[1]]
      assert err.max() <= 16, name  # half an e4m3 step at the top binade (448: steps of 32)
    else:
      np.testing.assert_array_equal(x, exact[name])


def _write_synthetic(directory, c, rng):
  """Random tensors under DeepSeek-V3's published names, dtypes and shapes (FP8 weights with
  weight_scale_inv, bfloat16 norms / embedding / router), in two shards + an index."""
  want = published_tensors(c)
  tensors = {}
  for name, (shape, dtype) in want.items():
    if dtype == 'F8_E4M3':
      continue
    if name.endswith('_scale_inv'):
      w = rng.normal(size=want[name[:-len('_scale_inv')]][0]).astype(np.float32) * 0.2
      tensors[name[:-len('_scale_inv')]], tensors[name] = fp8.quantize(w)
    elif len(shape) == 1 and 'bias' not in name:
      tensors[name] = (1 + 0.3 * rng.normal(size=shape)).astype(ml_dtypes.bfloat16)
    else:
      x = 0.3 * rng.normal(size=shape)
      tensors[name] = x.astype(np.float32 if dtype == 'F32' else ml_dtypes.bfloat16)
  for k in range(c['num_nextn_predict_layers']):  # the release repeats the shared tensors
    pre = f"model.layers.{c['num_hidden_layers'] + k}"
    tensors[f'{pre}.embed_tokens.weight'] = tensors['model.embed_tokens.weight']
    tensors[f'{pre}.shared_head.head.weight'] = tensors['lm_head.weight']
  os.makedirs(directory)
  names = sorted(tensors)
  files = {'model-00001-of-00002.safetensors': names[::2],
           'model-00002-of-00002.safetensors': names[1::2]}
  for file, keys in files.items():
    save_file({k: tensors[k] for k in keys}, os.path.join(directory, file),
              metadata={'format': 'pt'})
  with open(os.path.join(directory, INDEX), 'w') as f:
    json.dump({'weight_map': {k: file for file, keys in files.items() for k in keys}}, f)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    json.dump(c, f)
  return tensors


def _synthetic_config(q_lora_rank):
  args = ModelArgs.from_config(dsv3_model_config(1, q_lora_rank=q_lora_rank))
  c = hf_config.to_hf(args, 'deepseek_v3', fp8=True)
  c['moe_intermediate_size'] = 136  # > 128: a partial second FP8 block
  c['rope_scaling'], c['rope_theta'] = None, 50000.0
  c['tie_word_embeddings'] = False  # as the release
  return c


@pytest.mark.parametrize('q_lora_rank', [12, 0])
def test_synthetic_release_layout_checkpoint_loads_and_round_trips(tmp_path, q_lora_rank):
  """A checkpoint written independently of the exporter, in the release's exact layout
  (FP8 + scales, bfloat16 rest, shards), loads; exporting the loaded model gives back every
  tensor as its dequantised float32 value, bit for bit, under the same names."""
  c = _synthetic_config(q_lora_rank)
  src = _write_synthetic(str(tmp_path / 'v3'), c, np.random.default_rng(q_lora_rank))
  config, model = hf.load_dir(str(tmp_path / 'v3'))
  m = config.model
  assert (m.mla.q_lora_rank, m.moe.moe_intermediate_size) == (q_lora_rank, 136)
  assert config.model.rope_theta == 50000.0 and config.model.mtp.depth == 1
  out = export.to_hf_tensors(export.model_params(model), model.args, 'deepseek_v3')
  assert sorted(out) == sorted(k for k in src if not k.endswith('_scale_inv'))
  for name, x in out.items():
    want = src[name]
    if want.dtype == ml_dtypes.float8_e4m3fn:
      want = fp8.dequantize(want, src[f'{name}_scale_inv'])
    np.testing.assert_array_equal(x, want.astype(np.float32), err_msg=name)
  bias = model.layers[1].mlp.gate.e_score_correction_bias[...]
  np.testing.assert_array_equal(bias, src['model.layers.1.mlp.gate.e_score_correction_bias'])


def test_export_reimport_is_bit_exact_and_computes_the_same(dsv3, tmp_path):
  """float32 export (sharded: an index and several files) -> import: every tensor, the
  routing biases included, and so every depth's logits are identical."""
  args, model, _ = dsv3
  out = str(tmp_path / 'f32')
  written = export.export_model(model, out, 'deepseek_v3', shard_bytes=40_000)
  assert len([f for f in os.listdir(out) if f.endswith('.safetensors')]) > 2
  assert all(x.dtype == np.float32 for x in written.values())
  config, loaded = hf.load_dir(out)
  unused = {'n_kv_heads': 0, 'head_dim': 0}  # GQA's widths: no config.json field for MLA
  assert (dataclasses.replace(ModelArgs.from_config(config), **unused)
          == dataclasses.replace(args, **unused))
  _assert_same_tree(export.model_params(loaded), export.model_params(model))
  for a, b in zip(_logits(model, TOKENS), _logits(loaded, TOKENS)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- MiMo layout ----------------------------------------------------------------------------
# What vLLM's MiMoMultiTokenPredictorLayer (vllm/model_executor/models/mimo_mtp.py) and
# SGLang's (python/sglang/srt/models/mimo_mtp.py) hold per MTP layer, named as the
# checkpoint names them: model.mtp_layers.{i}. + these; their loaders send the first four to
# the layer itself and the rest to its Qwen2DecoderLayer `mtp_block` (q/k/v with biases).
MIMO_LAYER_KEYS = (
    'token_layernorm.weight', 'hidden_layernorm.weight', 'input_proj.weight',
    'final_layernorm.weight', 'input_layernorm.weight', 'post_attention_layernorm.weight',
    'self_attn.q_proj.weight', 'self_attn.q_proj.bias', 'self_attn.k_proj.weight',
    'self_attn.k_proj.bias', 'self_attn.v_proj.weight', 'self_attn.v_proj.bias',
    'self_attn.o_proj.weight', 'mlp.gate_proj.weight', 'mlp.up_proj.weight',
    'mlp.down_proj.weight')
QWEN2_LAYER_KEYS = MIMO_LAYER_KEYS[4:]


@pytest.mark.parametrize('tie', [True, False])
def test_mimo_names_and_round_trip(tie, tmp_path):
  c = tiny_model_config(2, tie_embeddings=tie)
  args, model = _model(c)
  params = export.model_params(model)
  tensors = export.to_hf_tensors(params, args, 'mimo')
  want = {'model.embed_tokens.weight', 'model.norm.weight', 'lm_head.weight'}
  want |= {f'model.layers.{i}.{k}' for i in range(args.n_layers) for k in QWEN2_LAYER_KEYS}
  want |= {f'model.mtp_layers.{i}.{k}' for i in range(2) for k in MIMO_LAYER_KEYS}
  assert set(tensors) == want
  d = args.d_model
  eh = params[('mtp', '0', 'eh_proj', 'kernel')]  # rows :d act on the embedding here
  np.testing.assert_array_equal(tensors['model.mtp_layers.0.input_proj.weight'][:, :d], eh[d:].T)
  np.testing.assert_array_equal(tensors['model.mtp_layers.0.input_proj.weight'][:, d:], eh[:d].T)
  assert not np.any(tensors['model.layers.1.self_attn.k_proj.bias'])
  assert tensors['model.layers.1.self_attn.k_proj.bias'].shape == (args.n_kv_heads * args.head_dim,)
  cfg = hf_config.to_hf(args, 'mimo')
  assert (cfg['architectures'], cfg['num_nextn_predict_layers']) == (['MiMoForCausalLM'], 2)
  assert ModelArgs.from_config(hf_config.to_config(cfg)) == args
  _assert_same_tree(_read_back(tmp_path / 'mimo', tensors, cfg), params)


def test_mimo_keeps_a_qwen2_trunks_biases_and_its_rope_scaling(tmp_path):
  """A model with q/k/v biases (an hf: Qwen2 trunk) exports them, flagged attention_bias,
  and reads back bit-exactly, its RoPE scaling too; zero biases must be zero."""
  c = tiny_model_config(2, attention_bias=True)
  c.model.rope_scaling.kind, c.model.rope_scaling.factor = 'linear', 2.0
  args, model = _model(c)
  params = export.model_params(model)
  bias = params[('layers', '1', 'self_attn', 'k_proj', 'bias')]
  assert np.any(bias)
  tensors = export.to_hf_tensors(params, args, 'mimo')
  np.testing.assert_array_equal(tensors['model.layers.1.self_attn.k_proj.bias'], bias.reshape(-1))
  cfg = hf_config.to_hf(args, 'mimo')
  assert cfg['attention_bias'] is True
  assert cfg['rope_scaling'] == {'rope_type': 'linear', 'factor': 2.0}
  assert ModelArgs.from_config(hf_config.to_config(cfg)) == args
  _assert_same_tree(_read_back(tmp_path / 'biased', tensors, cfg), params)
  plain = ModelArgs.from_config(tiny_model_config(2))
  with pytest.raises(InteropError, match='q_proj.bias is not zero but config.json'):
    _read_back(tmp_path / 'plain', tensors, hf_config.to_hf(plain, 'mimo'))


# -- the export command ---------------------------------------------------------------------
def _byte_vocab(config):
  config.model.vocab_size = 320  # the byte tokenizer's 258 ids, rounded up
  return config


@pytest.mark.parametrize('layout', ['deepseek_v3', 'mimo'])
def test_export_command_round_trip_is_bit_exact(tmp_path, capsys, layout):
  config = _byte_vocab(dsv3_model_config(1) if layout == 'deepseek_v3' else tiny_model_config(2))
  model = write_workdir(str(tmp_path / 'run'), config, seed=3)
  out = str(tmp_path / 'hf')
  assert export_cmd.main(['--workdir', str(tmp_path / 'run'), '--out', out, '--layout', layout,
                          '--json']) == 0
  summary = json.loads(capsys.readouterr().out)
  assert (summary['step'], summary['layout'], summary['mtp_depth']) == (3, layout,
                                                                        config.model.mtp.depth)
  _, loaded = hf.load_dir(out)
  _assert_same_tree(export.model_params(loaded), export.model_params(model))


def test_export_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys):
  """Without --step a broken newest checkpoint (a trainer's half-removed step) gives way to
  the one before, with a warning; with --step it is one error line."""
  run = str(tmp_path / 'run')
  write_workdir(run, _byte_vocab(tiny_model_config(1)), seed=2, steps=(3, 5))
  arrays = glob.glob(os.path.join(run, 'checkpoints', '5', 'state', '**', 'd', '*'),
                     recursive=True)
  largest = max(arrays, key=os.path.getsize)
  data = pathlib.Path(largest).read_bytes()
  pathlib.Path(largest).write_bytes(data[:len(data) // 2])
  assert export_cmd.main(['--workdir', run, '--out', str(tmp_path / 'a'), '--layout', 'llama',
                          '--json']) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out)['step'] == 3 and 'checkpoint 5' in captured.err
  assert _run(['--workdir', run, '--out', str(tmp_path / 'b'), '--layout', 'llama',
               '--step', '5']) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith('error: checkpoint 5'), err


def test_export_command_bad_input_is_one_line_exit_2(tmp_path, capsys):
  gqa, mla = str(tmp_path / 'gqa'), str(tmp_path / 'mla')
  write_workdir(gqa, _byte_vocab(tiny_model_config(1)), seed=1)
  write_workdir(mla, _byte_vocab(dsv3_model_config(1)), seed=1)
  os.makedirs(tmp_path / 'full')
  open(tmp_path / 'full' / 'x', 'w').close()
  out = str(tmp_path / 'o')
  cases = [
      (['--workdir', str(tmp_path / 'nope'), '--out', out, '--layout', 'mimo'], 'does not exist'),
      (['--workdir', gqa, '--out', out, '--layout', 'gpt2'], "invalid choice: 'gpt2'"),
      (['--workdir', gqa, '--out', out, '--layout', 'deepseek_v3'], 'needs MLA attention'),
      (['--workdir', mla, '--out', out, '--layout', 'mimo'], 'dense GQA'),
      (['--workdir', mla, '--out', out, '--layout', 'llama'], 'dense GQA'),
      (['--workdir', gqa, '--out', out, '--layout', 'mimo', '--fp8'], '--fp8'),
      (['--workdir', gqa, '--out', str(tmp_path / 'full'), '--layout', 'mimo'],
       'not an empty directory'),
      (['--workdir', gqa, '--out', out, '--layout', 'mimo', '--step', '9'], 'steps [3] only'),
      (['--workdir', gqa, '--out', out, '--layout', 'mimo', '--shard_mb', '0'], 'positive'),
  ]
  for argv, message in cases:
    code = _run(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith('error: ') and message in err[0], (argv, err)
  assert not os.path.exists(out)


def test_export_help_names_the_options_and_defaults(capsys):
  assert _run(['--help']) == 0
  text = capsys.readouterr().out
  for option in ('--workdir', '--out', '--layout', '--step', '--fp8', '--shard_mb', '--json',
                 'llama', 'deepseek_v3', 'mimo', 'default: 4096'):
    assert option in text, option


def _run(argv) -> int:
  """The command's exit code, flag errors (argparse's SystemExit) included."""
  try:
    return export_cmd.main(argv)
  except SystemExit as e:
    return e.code


# -- bad checkpoints --------------------------------------------------------------------------
def _corrupt(path, how):
  """A safetensors file truncated, with a bad header, or with a dtype nobody reads."""
  raw = pathlib.Path(path).read_bytes()
  n = int.from_bytes(raw[:8], 'little')
  if how == 'truncated':
    raw = raw[:-7]
  elif how == 'bad_header':
    raw = raw[:8] + b'{x' + raw[10:]
  else:
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != '__metadata__')
    header[name]['dtype'] = how
    text = json.dumps(header).encode()
    text += b' ' * (-len(text) % 8)
    raw = len(text).to_bytes(8, 'little') + text + raw[8 + n:]
  pathlib.Path(path).write_bytes(raw)


def test_bad_checkpoints_name_the_tensor_or_field(tmp_path, dsv3):
  args, model, fp8_dir = dsv3
  good = str(tmp_path / 'good')
  export.export_model(model, good, 'deepseek_v3')
  ckpt = _Dir(good)
  tensors = {k: ckpt[k] for k in ckpt.keys()}

  def variant(name, change=None, config=None):
    t = dict(tensors)
    if change:
      change(t)
    return _write(tmp_path / name, t, dict(ckpt.config, **(config or {})))

  def corrupt(how):
    d = variant(how)
    _corrupt(os.path.join(d, 'model.safetensors'), how)
    return d

  q = 'model.layers.1.self_attn.q_b_proj.weight'
  cases = [
      (str(tmp_path / 'absent'), 'does not exist'),
      (variant('no_tensor', lambda t: t.pop('model.layers.2.mlp.gate.weight')),
       'tensor model.layers.2.mlp.gate.weight is missing'),
      (variant('shape', lambda t: t.update({q: t[q][:-1]})), f'tensor {q} has shape'),
      (variant('extra', lambda t: t.update({'model.layers.9.enorm.weight': np.ones(3)})),
       'unexpected tensor model.layers.9.enorm.weight'),
      (variant('copy', lambda t: t.update({'model.layers.2.embed_tokens.weight':
                                           t['model.embed_tokens.weight'] + 1})),
       'shares Emb and OutHead'),
      (variant('no_mtp', lambda t: [t.pop(k) for k in list(t) if k.startswith('model.layers.3.')]),
       'no tensor of MTP depth 2 (model.layers.3.*)'),
      (variant('gpt2', config={'architectures': ['GPT2LMHeadModel']}),
       "architectures 'GPT2LMHeadModel' is not supported (unknown architecture); supported: "
       'LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, DeepseekV3ForCausalLM, '
       'MiMoForCausalLM'),
      (variant('yarn', config={'rope_scaling': {'type': 'yarn', 'factor': 40}}), "'yarn'"),
      (variant('softmax', config={'scoring_func': 'softmax'}), 'scoring_func'),
      (variant('int8', lambda t: t.update({q: t[q].astype(np.int8)})),
       f'tensor {q} has dtype I8; only F32, BF16, F16, F8_E4M3 are read'),
      (corrupt('truncated'), 'model.safetensors is not a readable safetensors file: truncated'),
      (corrupt('bad_header'), 'model.safetensors is not a readable safetensors file: a bad header'),
      (corrupt('Q4'), 'model.safetensors is not a readable safetensors file: a dtype the '
       'safetensors library does not know'),
  ]
  os.makedirs(tmp_path / 'no_config')
  cases.append((str(tmp_path / 'no_config'), 'no config.json in the directory'))
  fp8_ckpt = _Dir(fp8_dir)
  no_scale = {k: fp8_ckpt[k] for k in fp8_ckpt.keys() if k != f'{q}_scale_inv'}
  cases.append((_write(tmp_path / 'no_scale', no_scale, fp8_ckpt.config),
                f'{q} has no {q}_scale_inv'))
  for directory, message in cases:
    with pytest.raises(InteropError, match=re.escape(message)) as e:
      hf.load_dir(directory)
    assert '\n' not in str(e.value) and e.value.exit_code == 2
  args = ModelArgs.from_config(tiny_model_config(1))
  biased = export.to_hf_tensors(export.model_params(_model(tiny_model_config(1))[1]), args, 'mimo')
  biased['model.layers.0.self_attn.v_proj.bias'] += 1
  with pytest.raises(InteropError, match='v_proj.bias is not zero'):
    _read_back(tmp_path / 'biased', biased, hf_config.to_hf(args, 'mimo'))
  with pytest.raises(InteropError, match='sequential MTP modules only'):
    layouts.check_layout(ModelArgs.from_config(tiny_model_config(1, 'parallel')), 'mimo')


# -- against transformers' DeepseekV3 (torch, a test extra) -----------------------------------
@pytest.mark.slow
def test_logits_match_transformers_deepseek_v3_both_ways(tmp_path):
  """A transformers DeepseekV3ForCausalLM (interleaved RoPE) saved with save_pretrained loads
  here with its logits (max abs diff <= 1e-4), and this project's export loads in
  transformers with this project's logits: the rotary rows are permuted the right way."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  # Node-limited routing (8 experts in 4 groups, a token's 2 from its best 2 groups) is
  # DeepSeek-V3's, and transformers' DeepseekV3 implements it independently of moe.route.
  mcfg = dsv3_model_config(1, n_routed_experts=8, n_group=4, topk_group=2)
  args = ModelArgs.from_config(tokenizers.resolve_vocab_size(mcfg))
  hf_cfg = hf_config.to_hf(args, 'deepseek_v3')
  hf_cfg['num_nextn_predict_layers'] = 0  # transformers builds no MTP layer
  torch.manual_seed(0)
  ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_cfg)).eval()
  with torch.no_grad():
    for _, p in ref.named_parameters():
      p.copy_((1.0 if p.ndim == 1 else 0.0) + 0.3 * torch.randn_like(p))
    for name, b in ref.named_buffers():
      if 'e_score_correction_bias' in name:
        b.copy_(0.3 * torch.randn_like(b))
  ref.save_pretrained(str(tmp_path / 'ref'))
  tokens = torch.tensor(TOKENS, dtype=torch.long)
  with torch.no_grad():
    want = ref(tokens).logits.numpy()
  _, loaded = hf.load_dir(str(tmp_path / 'ref'))
  assert loaded.args.mtp_depth == 0
  got = np.asarray(_logits(loaded, TOKENS)[0])
  assert np.abs(got - want).max() <= 1e-4 and np.abs(want).max() > 1
  _, model = _model(mcfg, seed=4)  # the other way, with an MTP layer transformers skips
  export.export_model(model, str(tmp_path / 'ours'), 'deepseek_v3')
  back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / 'ours')).eval()
  with torch.no_grad():
    theirs = back(tokens).logits.numpy()
  ours = np.asarray(_logits(model, TOKENS)[0])
  assert np.abs(ours - theirs).max() <= 1e-4 and np.abs(ours).max() > 1


def test_exported_files_are_readable_like_the_rest_of_the_directory(tmp_path):
  """safetensors writes 0600; an export's weights get the mode its config.json gets."""
  tensors = {f'w{i}': np.full((64,), i, np.float32) for i in range(3)}
  (tmp_path / 'probe.json').write_text('{}')
  want = os.stat(tmp_path / 'probe.json').st_mode & 0o777
  for name, shard in (('one', 1 << 20), ('sharded', 256)):
    names = write_dir(str(tmp_path / name), tensors, shard_bytes=shard)
    assert len(names) == (1 if name == 'one' else 4)
    for file in names:
      assert os.stat(tmp_path / name / file).st_mode & 0o777 == want, (file, oct(want))
