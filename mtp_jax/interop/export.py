"""This project's models -> Hugging Face-layout directories that serving code loads.

An export directory holds config.json (hf_config.py: `architectures` / `model_type` that
transformers' AutoModelForCausalLM builds the trunk from), generation_config.json, the
weights (safetensors_io.py, named by layouts.py) and the tokenizer: a Hugging Face trunk's
own files, a SentencePiece model as tokenizer.model, or for the byte tokenizer a
tokenizer.json that gives byte b the id b + 2 (pad 0, eos 1) as ByteTokenizer does.
`--init_from hf:DIR` reads every export back (hf.py); float32 exports read back bit-exactly,
FP8 ones as their dequantised values.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import jax
import numpy as np
import sentencepiece
from flax import nnx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import mtp_jax.interop.fp8 as fp8_lib
import mtp_jax.interop.hf_config as hf_config
import mtp_jax.interop.layouts as layouts
from mtp_jax.checkpoint.reader import load_workdir, path_names
from mtp_jax.data import tokenizers
from mtp_jax.interop.safetensors_io import SHARD_BYTES, InteropError, write_dir
from mtp_jax.model import moe
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.mtp import MTPModel
from mtp_jax.train_state.restore import restore_model_at

LAYOUTS = layouts.LAYOUTS
# A Hugging Face trunk's tokenizer files, copied when present.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'added_tokens.json', 'vocab.json', 'merges.txt', 'tokenizer.model')
# The byte tokenizer's two special ids, named as no source text is likely to spell them
# (a tokenizer matches its special tokens' text before anything else).
BYTE_SPECIALS = {'<|pad|>': tokenizers.PAD_ID, '<|eos|>': tokenizers.EOS_ID}


def model_params(model: MTPModel) -> dict:
  """{path (str keys, no '.value' leaf): numpy array} of the Params and routing biases."""
  state = nnx.state(model, nnx.Any(nnx.Param, moe.RoutingBias))
  return {path_names(p)[:-1]: np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def to_hf_tensors(params: dict, args: ModelArgs, layout: str, fp8: bool = False) -> dict:
  """{Hugging Face name: numpy array} of model_params' dict, in table order.

  fp8 (deepseek_v3): the tensors DeepSeek-V3's release stores as FP8 are quantised in
  128 x 128 blocks with a weight_scale_inv each (lossy).
  """
  if fp8 and layout != 'deepseek_v3':
    raise InteropError(f'--fp8 is the deepseek_v3 layout\'s weight format; {layout} has none')
  table = layouts.tensor_table(args, layout)
  out = {}
  for t in table:
    if t.kind == 'zero':
      out[t.name] = np.zeros(t.shape, np.float32)
    elif t.kind == 'alias':
      out[t.name] = out[t.of] if t.of in out else out['model.embed_tokens.weight']
    else:
      out.update(zip(t.names(), layouts.to_hf(t, params[t.path])))
  if not fp8:
    return out
  quantised = {}
  for name, x in out.items():
    if name in layouts.fp8_names(table):
      quantised[name], quantised[name + fp8_lib.SCALE_SUFFIX] = fp8_lib.quantize(x)
    else:
      quantised[name] = x
  return quantised


# -- the serving side's files -------------------------------------------------------------
def byte_tokenizer_json() -> str:
  """tokenizer.json of ByteTokenizer: byte b -> id b + 2 (GPT-2's byte-level alphabet,
  no merges), pad 0 and eos 1 as special tokens."""
  offset = tokenizers.BYTE_VOCAB_SIZE - 256
  vocab = dict(BYTE_SPECIALS)
  chars = tokenizers.byte_level_chars()
  vocab.update({c: b + offset for c, b in chars.items()})
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(s, special=True) for s in BYTE_SPECIALS])
  return tok.to_str()


def _write_json(path: str, obj: dict) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write('\n')


def write_tokenizer(directory: str, data_config) -> dict:
  """The tokenizer files of data.tokenizer into DIR; {bos/eos/pad_token_id} for config.json."""
  kind = data_config.tokenizer
  if kind == 'byte':
    with open(os.path.join(directory, 'tokenizer.json'), 'w', encoding='utf-8') as f:
      f.write(byte_tokenizer_json())
    pad, eos = list(BYTE_SPECIALS)
    _write_json(os.path.join(directory, 'tokenizer_config.json'), {
        'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': eos, 'pad_token': pad,
        'bos_token': None, 'model_max_length': 1 << 30, 'clean_up_tokenization_spaces': False})
    return {'bos_token_id': None, 'eos_token_id': tokenizers.EOS_ID,
            'pad_token_id': tokenizers.PAD_ID}
  tok = tokenizers.get_tokenizer(data_config)
  ids = {'bos_token_id': None, 'eos_token_id': tok.eos_id, 'pad_token_id': tok.pad_id}
  if kind == 'sentencepiece':  # ids as trained: no bos, no dummy prefix (train_sentencepiece)
    path = os.path.expanduser(data_config.spm_model)
    shutil.copyfile(path, os.path.join(directory, 'tokenizer.model'))
    piece = sentencepiece.SentencePieceProcessor(model_file=path).id_to_piece
    _write_json(os.path.join(directory, 'tokenizer_config.json'), {
        'tokenizer_class': 'LlamaTokenizer', 'add_bos_token': False, 'add_eos_token': False,
        'add_prefix_space': False, 'legacy': False, 'bos_token': None,
        'eos_token': piece(tok.eos_id), 'pad_token': piece(tok.pad_id),
        'model_max_length': 1 << 30, 'clean_up_tokenization_spaces': False})
    return ids
  source = os.path.abspath(os.path.expanduser(data_config.hf_tokenizer))
  for name in TOKENIZER_FILES:
    if os.path.isfile(os.path.join(source, name)):
      shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
  try:
    with open(os.path.join(source, 'config.json'), encoding='utf-8') as f:
      bos = json.load(f).get('bos_token_id')
    ids['bos_token_id'] = bos if isinstance(bos, int) and not isinstance(bos, bool) else None
  except (OSError, ValueError, AttributeError):
    pass
  return ids


def generation_config(token_ids: dict) -> dict:
  """generation_config.json: the tokenizer's ids; greedy unless the caller samples."""
  return {k: v for k, v in token_ids.items() if v is not None}


def export_model(model: MTPModel, directory: str, layout: str, *, fp8: bool = False,
                 shard_bytes: int = SHARD_BYTES, data_config=None,
                 max_positions: int = 0) -> dict:
  """Writes the model (and data_config's tokenizer, when given) as a Hugging Face-layout
  directory; returns the tensors written, by name.

  Without fp8 every tensor is float32 as trained and reading it back is bit-exact. The
  llama layout holds the trunk only (no MTP names exist for it).
  """
  args = model.args
  tensors = to_hf_tensors(model_params(model), args, layout, fp8)
  os.makedirs(directory, exist_ok=True)
  ids = write_tokenizer(directory, data_config) if data_config is not None else {}
  config = hf_config.to_hf(args, layout, max_positions=max_positions or 4096, fp8=fp8,
                           tokens=ids)
  _write_json(os.path.join(directory, 'config.json'), config)
  _write_json(os.path.join(directory, 'generation_config.json'), generation_config(ids))
  write_dir(directory, tensors, shard_bytes)
  return tensors


def export_workdir(workdir: str, directory: str, layout: str, *, step: int | None = None,
                   fp8: bool = False, shard_bytes: int = SHARD_BYTES, notify=None) -> dict:
  """A training workdir's checkpoint exported as export_model does; returns a summary.

  Without `step`, the newest intact checkpoint: a live trainer may remove or be writing
  the newest one, and the read falls back to the one before (read-only, one warning).
  The layout is checked against the saved config before anything is restored.
  """
  if layout not in LAYOUTS:
    raise InteropError(f'--layout must be one of {", ".join(LAYOUTS)}, got {layout!r}')
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise InteropError(f'--out {directory!r} exists and is not an empty directory')
  kw = {} if notify is None else {'notify': notify}
  config, newest = load_workdir(workdir, step, **kw)
  args = ModelArgs.from_config(config)
  layouts.check_layout(args, layout)
  if fp8 and layout != 'deepseek_v3':
    raise InteropError(f'--fp8 is the deepseek_v3 layout\'s weight format; {layout} has none')
  model, step = restore_model_at(config, workdir, newest, fallback=step is None, job='interop',
                                 **kw)
  tensors = export_model(model, directory, layout, fp8=fp8, shard_bytes=shard_bytes,
                         data_config=config.data, max_positions=config.model.max_positions
                         or max(4096, config.data.seq_len))
  written = [] if layout == 'llama' or not args.mtp_depth else list(range(1, args.mtp_depth + 1))
  return {'step': step, 'layout': layout, 'out': directory, 'tensors': len(tensors),
          'bytes': int(sum(t.nbytes for t in tensors.values())),
          'mtp_depth': args.mtp_depth, 'mtp_depths_written': len(written), 'fp8': fp8,
          'params': int(sum(math.prod(t.shape) for n, t in tensors.items()
                            if not n.endswith(fp8_lib.SCALE_SUFFIX)))}
