"""Hugging Face directories into this project: `--init_from hf:DIR`, `load_dir`, and
`params_from_hf` for tensors already in memory.

DIR is a local directory in the standard layout (config.json, model.safetensors or shards
with model.safetensors.index.json, tokenizer.json or else a SentencePiece tokenizer.model);
nothing is ever downloaded. Every layout the exporter writes is read (layouts.py): a
Llama / Mistral / Qwen2 trunk, DeepSeek-V3 (MLA, MoE, FP8 block scales, MTP layers) and
MiMo (a Qwen2 trunk with MTP layers). Three steps, each with one-line errors naming the
field or tensor, all before anything compiles:
  `apply_to_config`  config.json -> config.model (hf_config.py) and data.tokenizer = 'hf'
                     on DIR's tokenizer; the MTP fields (depth, kind) stay the config's;
  `check_weights`    every tensor to load present with its shape and a dtype that is read,
                     nothing unknown (safetensors headers only, no weight is read);
  `load_into`        tensor by tensor straight into the sharded target: each device's
                     block is sliced out of the file where the layout allows it (plain
                     and head-split tensors), so a host holds one tensor's local blocks at
                     a time; FP8, permuted-RoPE and expert-stacked tensors are read whole,
                     one at a time.
MTP depths 1..min(the config's, the checkpoint's) are loaded from the checkpoint's MTP
layers when the config's MTP modules are sequential; deeper ones keep their fresh
initialisation, as every MTP module of a plain causal LM does.
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from flax import nnx

import mtp_jax
import mtp_jax.interop.fp8 as fp8_lib
import mtp_jax.interop.hf_config as hf_config
import mtp_jax.interop.layouts as layouts
from mtp_jax.checkpoint.reader import path_names
from mtp_jax.config.validation import validate
from mtp_jax.data import tokenizers
from mtp_jax.interop.safetensors_io import InteropError, MemoryReader, Reader, read_json
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.mtp import MTPModel
from mtp_jax.runtime import peak as peak_lib
from mtp_jax.train_state.init_from import HF_PREFIX

PREFIX = HF_PREFIX
SUPPORTED = hf_config.ARCHITECTURES
Tensor = layouts.Tensor


def _where(directory: str) -> str:
  return f'--init_from hf:{directory}'


def read_config(directory: str, where: str | None = None) -> dict:
  """config.json of a local model directory; InteropError when it is not one."""
  if not directory:
    where = where or '--init_from hf:DIR'
    after = '' if where != '--init_from hf:DIR' else ' after hf:'
    raise InteropError(f'{where} needs a local directory{after} (nothing is downloaded from '
                       'the Hugging Face hub)')
  where = where or _where(directory)
  if not os.path.isdir(directory):
    what = 'does not exist' if not os.path.exists(directory) else 'is not a directory'
    raise InteropError(f'{where}: {what}: give a local directory holding config.json and '
                       '*.safetensors (nothing is downloaded from the Hugging Face hub)')
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise InteropError(f'{where}: no config.json in the directory')
  return read_json(path, where)


def _set_tokenizer(config, directory: str, where: str, changed: list) -> None:
  """data.tokenizer: DIR's tokenizer.json, else its SentencePiece tokenizer.model."""
  def put(node, name, value, dotted):
    if node[name] != value:
      changed.append(f'{dotted}: {node[name]!r} -> {value!r}')
      node[name] = value

  spm_path = os.path.join(directory, 'tokenizer.model')
  if (not os.path.isfile(os.path.join(directory, 'tokenizer.json'))
      and os.path.isfile(spm_path)):
    # A slow-tokenizer-only release (Llama 2 style): its SentencePiece model, ids as
    # released; no bos is added (documents are separated by eos), pad falls back to eos.
    put(config.data, 'tokenizer', 'sentencepiece', 'data.tokenizer')
    put(config.data, 'spm_model', spm_path, 'data.spm_model')
    tok, name = tokenizers.SentencePieceTokenizer.from_file(spm_path), 'tokenizer.model'
  else:
    put(config.data, 'tokenizer', 'hf', 'data.tokenizer')
    put(config.data, 'hf_tokenizer', directory, 'data.hf_tokenizer')
    tok, name = tokenizers.HFTokenizer.from_dir(directory), 'tokenizer.json'  # errors now
  if tok.vocab_size > config.model.vocab_size:
    raise InteropError(f'{where}: {name} has {tok.vocab_size} tokens but config.json '
                       f'vocab_size is {config.model.vocab_size}')


def apply_to_config(config, directory: str) -> list[str]:
  """Sets config.model from DIR's config.json and data.tokenizer to DIR's tokenizer.

  Returns 'field: old -> new' for each value it changed (the trainer reports them). The
  MTP depth and kind and the training switches stay the config's; the MTP blocks of a
  checkpoint with MTP layers take its block kinds (model.mtp.block_* = ''). directory: an
  absolute path, as InitFrom.parse gives it.
  """
  where = _where(directory)
  family, fields = hf_config.model_fields(read_config(directory), where)
  fields.pop('mtp.depth')
  if family in ('deepseek_v3', 'mimo'):
    fields.update({'mtp.block_attention': '', 'mtp.block_mlp': ''})
  changed = hf_config.set_fields(config.model, fields)
  _set_tokenizer(config, directory, where, changed)
  return changed


# -- what a directory holds for a model ---------------------------------------------------
@dataclasses.dataclass
class Source:
  """The tensors of DIR that one model loads, checked against its headers."""
  directory: str
  where: str
  family: str
  layout: str
  table: list  # the layouts.Tensor entries to load (trunk + the loaded MTP depths)
  depths: int  # MTP depths loaded from the checkpoint
  checkpoint_depths: int  # MTP layers the checkpoint declares
  reader: Reader | MemoryReader

  def close(self):
    self.reader.close()


def _full_args(args: ModelArgs, mtp_depth: int) -> ModelArgs:
  """args with the checkpoint's MTP depths, sequential, in the layout's block kinds."""
  return dataclasses.replace(args, mtp_depth=mtp_depth, mtp_kind='sequential',
                             mtp_block_attention='', mtp_block_mlp='', share_modules=False,
                             strict_leaps=False)


def _shape_error(where: str, t: Tensor, shape: tuple, args: ModelArgs) -> InteropError:
  if args.attention == 'mla':
    sizes = (f'hidden_size {args.d_model}, heads {args.n_heads}, kv_lora_rank '
             f'{args.kv_lora_rank}, q_lora_rank {args.q_lora_rank}, vocab_size {args.vocab_size}')
  else:
    sizes = (f'hidden_size {args.d_model}, heads {args.n_heads}, kv heads {args.n_kv_heads}, '
             f'head_dim {args.head_dim}, intermediate_size {args.mlp_dim}, vocab_size '
             f'{args.vocab_size}')
  return InteropError(f'{where}: tensor {t.name} has shape {list(shape)} but config.json '
                      f'implies {list(t.shape)} ({sizes})')


def _check_tensor(reader: Reader | MemoryReader, where: str, name: str, t: Tensor,
                  args: ModelArgs) -> set:
  """The names `name` needs (itself, its FP8 scale), once its shape and dtype are right."""
  if name not in reader:
    raise InteropError(f'{where}: tensor {name} is missing from the safetensors files')
  shape = reader.shape(name)
  if shape != t.shape:
    raise _shape_error(where, dataclasses.replace(t, name=name), shape, args)
  reader.check_dtype(name)
  if reader.dtype(name) != 'F8_E4M3':
    return {name}
  scale = name + fp8_lib.SCALE_SUFFIX
  if scale not in reader:
    raise InteropError(f'{where}: FP8 tensor {name} has no {scale}')
  want = fp8_lib.scale_shape(t.shape)
  if reader.shape(scale) != want:
    raise InteropError(f'{where}: {scale} has shape {list(reader.shape(scale))}, expected '
                       f'{list(want)} for a {list(t.shape)} weight in {fp8_lib.BLOCK} x '
                       f'{fp8_lib.BLOCK} blocks')
  return {name, scale}


def open_source(directory: str, args: ModelArgs, where: str | None = None,
                all_depths: bool = False) -> Source:
  """DIR's tensors for `args`, every one checked (name, shape, dtype, FP8 scale) and
  nothing unknown left over; InteropError naming the tensor otherwise.

  all_depths: every MTP layer the checkpoint declares must be there and is loaded (args
  then has the checkpoint's depth); otherwise depths 1..min(args', checkpoint's) load,
  and a depth the files lack entirely (transformers' save_pretrained drops MTP layers)
  stays fresh.
  """
  where = where or _where(directory)
  cfg = read_config(directory, where)
  reader = Reader(directory, where)
  try:
    return _checked_source(reader, cfg, args, where, all_depths, directory)
  except BaseException:
    reader.close()
    raise


def _checked_source(reader, cfg: dict, args: ModelArgs, where: str, all_depths: bool,
                    directory: str = '') -> Source:
  """open_source's checks over any reader (a directory's or tensors in memory)."""
  family, fields = hf_config.model_fields(cfg, where)
  layout = hf_config.LAYOUT_OF[family]
  ckpt_depth = fields['mtp.depth'] if layout != 'llama' else 0
  full = layouts.tensor_table(_full_args(args, ckpt_depth), layout, depths=ckpt_depth)
  wanted = args.mtp_modules() if args.mtp_head().hf_layer else 0  # shared: layer 1 only
  depths = min(wanted, ckpt_depth) if not all_depths else ckpt_depth
  for k in range(1, depths + 1):
    pre = layouts.mtp_prefix(layout, args, k) + '.'
    if not any(n.startswith(pre) for n in reader.keys()):
      if all_depths:
        raise InteropError(f'{where}: num_nextn_predict_layers={ckpt_depth} but no tensor '
                           f'of MTP depth {k} ({pre}*); transformers\' save_pretrained '
                           'drops MTP layers')
      depths = k - 1
      break

  def loaded(t):
    return t.path is None or t.path[0] != 'mtp' or int(t.path[1]) < depths

  table, used = [t for t in full if loaded(t)], set()
  for t in table:
    if t.kind == 'alias' and t.name not in reader:
      continue
    for name in t.names():
      used |= _check_tensor(reader, where, name, t, args)
  known = used | {n for t in full for n in t.names()}
  known |= {n + fp8_lib.SCALE_SUFFIX for n in known}
  extra = sorted(n for n in reader.keys()
                 if n not in known and not n.endswith(layouts.IGNORED_SUFFIXES))
  if extra:
    more = f' and {len(extra) - 3} more' if len(extra) > 3 else ''
    raise InteropError(f'{where}: unexpected tensor {", ".join(extra[:3])}{more}: not part '
                       f'of a {args.n_layers}-layer {family} model as config.json '
                       'describes it')
  return Source(directory, where, family, layout, table, depths, ckpt_depth, reader)


def check_weights(directory: str, args: ModelArgs) -> dict:
  """{name: (shape, dtype)} of the tensors `args` loads from DIR, once every one is known to
  be there with the shape config.json implies and nothing unknown is left; InteropError
  naming the tensor otherwise. Reads headers only."""
  src = open_source(directory, args)
  try:
    return {n: (src.reader.shape(n), src.reader.dtype(n))
            for t in src.table if t.name in src.reader for n in t.names()}
  finally:
    src.close()


def _read(reader: Reader | MemoryReader, where: str, name: str) -> np.ndarray:
  """A whole tensor as float32, FP8 dequantised by its weight_scale_inv."""
  x = reader.get(name)
  if reader.dtype(name) == 'F8_E4M3':
    return fp8_lib.dequantize(x, reader.get(name + fp8_lib.SCALE_SUFFIX).astype(np.float32))
  return x.astype(np.float32)


def read_param(src: Source, t: Tensor, shape: tuple) -> np.ndarray:
  """Parameter `t` (float32, `shape`) read whole."""
  return layouts.to_param(t, [_read(src.reader, src.where, n) for n in t.names()], shape)


def check_derived(src: Source) -> None:
  """The tensors with no parameter: aliases must equal what they copy, zeros be zero."""
  for t in src.table:
    if t.kind == 'alias' and t.name in src.reader:
      if not np.array_equal(_read(src.reader, src.where, t.name),
                            _read(src.reader, src.where, t.of)):
        raise InteropError(f'{src.where}: {t.name} differs from {t.of}; this project shares '
                           'Emb and OutHead across depths (and ties them when '
                           'tie_word_embeddings)')
    elif t.kind == 'zero' and np.any(_read(src.reader, src.where, t.name)):
      raise InteropError(f'{src.where}: {t.name} is not zero but config.json has '
                         'attention_bias=false (a model without q/k/v biases)')


def load_into(directory: str, args: ModelArgs, targets: dict, source: Source | None = None
              ) -> dict:
  """{path: jax.Array} for the parameters DIR holds, each built on its target's sharding.

  targets: {path (as in Tensor.path): jax.ShapeDtypeStruct with a sharding}. Every
  device's block is made on its own (make_array_from_callback), float32 (or the target
  dtype) from F32 / BF16 / F16 / FP8.
  """
  src = source or open_source(directory, args)
  out = {}
  try:
    check_derived(src)
    for t in src.table:
      if t.path is None:
        continue
      target = targets[t.path]
      blocks = {}  # devices holding the same block (replicas) share one read
      if t.sliceable and src.reader.dtype(t.name) != 'F8_E4M3':
        def block(index, t=t, target=target, blocks=blocks):
          key = str(index)
          if key not in blocks:
            file_index, finish = layouts.block_index(t, index, target.shape)
            blocks[key] = finish(src.reader.block(t.name, file_index)).astype(target.dtype)
          return blocks[key]
      else:
        whole = read_param(src, t, target.shape).astype(target.dtype)

        def block(index, whole=whole):
          return whole[index]
      out[t.path] = jax.make_array_from_callback(target.shape, target.sharding, block)
  finally:
    if source is None:
      src.close()
  return out


def describe(directory: str, args: ModelArgs, loaded: int, src: Source | None = None) -> str:
  depths = src.depths if src is not None else 0
  kind = f' ({src.family})' if src is not None else ''
  parts = [f'Initialised from hf:{directory}{kind}: trunk, embedding and head loaded '
           f'({loaded} tensors)']
  if depths:
    parts.append(f'MTP depth(s) 1..{depths} loaded from its MTP layers')
  if args.mtp_depth > depths:
    parts.append(f'{args.mtp_depth - depths} MTP depth(s) freshly initialised')
  return '; '.join(parts) + '; optimizer, step and data start fresh.'


def init_state(directory: str, config, state, notify=print):
  """The train state (model, optimizer) with DIR's weights in the parameters it holds.

  Every loaded array takes the sharding of the leaf it replaces; the fresh MTP modules and
  the optimizer state stay as they are. Returns (state, description).
  """
  args = ModelArgs.from_config(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  paths = [path_names(p) for p, _ in flat]
  # The model half of the (model, optimizer) state: ('0', ..., '.value').
  targets = {p[1:-1]: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
             for p, (_, x) in zip(paths, flat) if p[0] == '0'}
  src = open_source(directory, args)
  try:
    loaded = load_into(directory, args, targets, src)
  finally:
    src.close()
  leaves = [loaded.get(p[1:-1], x) if p[0] == '0' else x for p, (_, x) in zip(paths, flat)]
  desc = describe(directory, args, len(loaded), src)
  notify(desc)
  return jax.tree_util.tree_unflatten(treedef, leaves), desc


def load_model(directory: str, config) -> MTPModel:
  """An MTPModel on this process's first device: DIR's weights, fresh MTP depths beyond
  the checkpoint's. config: one on which apply_to_config(config, DIR) has run. For
  decoding and tests; training goes through init_state. model.dtype 'auto' resolves for an
  import (float32: its logits match transformers'); config.model.dtype is set to it."""
  peak_lib.resolve_model_dtype(config, 'interop')
  args = ModelArgs.from_config(config)
  model = MTPModel(args, rngs=nnx.Rngs(config.seed))
  graphdef, state = nnx.split(model)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  paths = [path_names(p)[:-1] for p, _ in flat]  # without the '.value' leaf
  targets = {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)
             for p, (_, x) in zip(paths, flat)}
  loaded = load_into(directory, args, targets)
  leaves = [loaded.get(p, x) for p, (_, x) in zip(paths, flat)]
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


def _param_shapes(args: ModelArgs) -> dict:
  """{path (as in Tensor.path): shape} of a model of `args`; no array is created."""
  state = nnx.state(nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0))))
  return {path_names(p)[:-1]: x.shape
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def params_from_hf(tensors, config_json: dict, where: str = 'tensors') -> dict:
  """{path: float32 numpy array} of the model config.json describes, from its tensors by
  Hugging Face name: the inverse of export.to_hf_tensors, keyed as export.model_params.

  tensors: {name: array} in memory (numpy, or what np.asarray takes; FP8 weights with their
  weight_scale_inv), or a safetensors_io.Reader, whose tensors are read one at a time. Every
  MTP layer config.json declares is loaded. The same checks as a directory (names, shapes,
  dtypes, nothing unknown, tied and zero tensors) raise one InteropError line naming `where`
  and the tensor.
  """
  config = hf_config.to_config(config_json, where)
  validate(config)  # a config.json value out of range: one ConfigError line
  args = ModelArgs.from_config(config)
  reader = tensors if isinstance(tensors, (Reader, MemoryReader)) else MemoryReader(tensors,
                                                                                  where)
  src = _checked_source(reader, config_json, args, where, all_depths=True)
  check_derived(src)
  shapes = _param_shapes(args)
  return {t.path: read_param(src, t, shapes[t.path]) for t in src.table if t.path is not None}


def load_dir(directory: str, base=None) -> tuple:
  """(config, model) of a Hugging Face-layout directory, exactly as it is: its MTP layers
  are the model's MTP depths (all of them must be there), its tokenizer the config's when
  it has one. InteropError on bad input, before anything compiles. The weights go through
  params_from_hf (float32 on the host), then onto this process's first device."""
  directory = os.path.abspath(os.path.expanduser(directory))
  where = directory
  cfg = read_config(directory, where)
  config = hf_config.to_config(cfg, where, base)
  if any(os.path.isfile(os.path.join(directory, n)) for n in ('tokenizer.json',
                                                              'tokenizer.model')):
    _set_tokenizer(config, directory, where, [])
  validate(config)  # a config.json value out of range: one ConfigError line
  with Reader(directory, where) as reader:
    params = params_from_hf(reader, cfg, where)
  peak_lib.resolve_model_dtype(config, 'interop')  # 'auto': float32, as transformers computes
  model = MTPModel(ModelArgs.from_config(config), rngs=nnx.Rngs(config.seed))
  graphdef, state = nnx.split(model)
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  leaves = []
  for p, x in flat:
    w = params.pop(path_names(p)[:-1], None)  # each host copy freed once placed
    leaves.append(x if w is None else jax.device_put(w.astype(x.dtype), device))
  return config, nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


def __getattr__(name: str):  # a name an earlier release had here: mtp_jax.MOVED_NAMES
  return mtp_jax.moved_name(__name__, name)
