"""Compiling the real train step, eval step and decode loop for a slice, and reading each
compiled program's memory, cost analysis and HLO into the report (a dict, per chip).

The model picks some kernels by backend while it is traced (attention core, MoE dispatch,
decode cache layout); here the process runs on CPU, so tracing pretends to be the target
platform for as long as the programs are built (devices.traced_for).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax.train.aot.figures as figures
import mtp_jax.train.aot.pricing as pricing
from mtp_jax.checkpoint.store import abstract_like
from mtp_jax.config.readers import decode_prompt_len
from mtp_jax.config.validation import validate
from mtp_jax.data import tokenizers
from mtp_jax.decode import decoder as decoder_lib
from mtp_jax.decode.sampling import Sampling
from mtp_jax.errors import RequestError
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.mtp import MTPModel
from mtp_jax.runtime import sharding
from mtp_jax.train import steps
from mtp_jax.train.aot.devices import Topology, no_jax_cache, topology_devices, traced_for
from mtp_jax.train.aot.figures import GIB, PROGRAMS, DoesNotFit
from mtp_jax.train.aot.hlo import analyze_hlo
from mtp_jax.train_state.state import create_model_and_optimizer

try:  # jaxlib's HLO print options (not public API; without them large constants read {...})
  from jaxlib import _hlo as _hlo_print
except ImportError:  # pragma: no cover
  _hlo_print = None


# -- per-chip bytes of sharded arrays ----------------------------------------------------
def shard_bytes(x) -> int:
  shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) else x.shape
  return int(math.prod(shape)) * jnp.dtype(x.dtype).itemsize


def _path(path) -> str:
  parts = []
  for k in path:
    key = getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))
    parts.append(str(key))
  return '.'.join(parts)


def spec_text(sh) -> str:
  spec = getattr(sh, 'spec', None)
  return 'replicated' if spec is None or all(a is None for a in spec) else str(tuple(spec))


# -- the programs ------------------------------------------------------------------------
def _memory(compiled) -> dict:
  ma = compiled.memory_analysis()
  out = {k: int(getattr(ma, f'{k}_size_in_bytes', 0) or 0)
         for k in ('argument', 'output', 'alias', 'temp', 'generated_code')}
  out['total'] = (out['argument'] + out['output'] - out['alias'] + out['temp']
                  + out['generated_code'])
  return out


def _cost(compiled) -> dict:
  ca = compiled.cost_analysis()
  ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
  return {'flops': float(ca.get('flops', 0.0)),
          'bytes_accessed': float(ca.get('bytes accessed', 0.0))}


_OOM_USED = re.compile(r'Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm', re.I)
_OOM_BY = re.compile(r'Exceeded hbm capacity by ([\d.]+[KMGT]?)', re.I)


_UNITS = {'': 1, 'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}


def _gib(text: str) -> float:
  m = re.fullmatch(r'([\d.]+)([KMGT]?)i?B?', text.strip())
  return float(m.group(1)) * _UNITS[m.group(2)] / GIB if m else float('nan')


def _shortfall_line(program: str, topo: Topology, text: str, hint: str = '') -> str:
  """One line from the TPU compiler's out-of-memory error (its two spellings)."""
  need = have = None
  m = re.search(r'required for ([\w ]+?) \(([\d.]+[KMGT]?)\) exceeds available HBM '
                r'\(([\d.]+[KMGT]?)\)', text)
  what = 'memory'
  if m:
    what, need, have = m.group(1), _gib(m.group(2)), _gib(m.group(3))
  m = re.search(r'Used ([\d.]+[KMGT]?) of ([\d.]+[KMGT]?) hbm', text, re.I)
  if m:
    need, have = _gib(m.group(1)), _gib(m.group(2))
  sizes = re.findall(r'Size: ([\d.]+[KMGT]?)', text)
  shapes = re.findall(r'Shape: (\S+)', text)
  largest = ', '.join(f'{_gib(a):.2f} GiB {b.split("{")[0]}' for a, b in zip(sizes[:3], shapes[:3]))
  head = (f'{program} step needs {need:.2f} GiB per chip for {what}, a {topo.chip.name} chip '
          f'has {have:.2f} GiB (short by {need - have:.2f} GiB)' if need is not None
          else f'{program} step does not fit a {topo.chip.name} chip: '
          + ' '.join(text.split())[:200])
  tail = f'; largest allocations: {largest}' if largest else (f'; {hint}' if hint else '')
  return f'does not fit {topo.name}: {head}{tail}'


def _compile(lowered, program: str, topo: Topology, hint: str = ''):
  try:
    return lowered.compile()
  except Exception as e:  # pylint: disable=broad-except
    text = str(e)
    if 'RESOURCE_EXHAUSTED' in text or 'Ran out of memory' in text:
      raise DoesNotFit(_shortfall_line(program, topo, text, hint)) from e
    raise


def _target_config(config, platform: str):
  """The config as the target resolves it: vocab from the tokenizer, backend-dependent
  'auto' choices left to the model (traced under traced_for)."""
  config = config.copy_and_resolve_references()
  tokenizers.resolve_vocab_size(config)
  return config


def _batch_structs(config, mesh, batch_size=None):
  with sharding.use_mesh(mesh, sharding.rules_of(config)):
    bsh = sharding.batch_sharding(mesh)
  b, t = batch_size or config.data.batch_size, config.data.seq_len
  batch = {k: jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=bsh)
           for k in ('tokens', 'segment_ids', 'positions')}
  return batch, {k: bsh for k in batch}


def _state_summary(abstract_state, shardings) -> dict:
  params = optimizer = 0
  leaves = []
  for (path, x), sh in zip(jax.tree_util.tree_leaves_with_path(abstract_state),
                           jax.tree.leaves(shardings)):
    name = _path(path)
    nbytes = shard_bytes(x)
    if name.startswith('0.'):
      params += nbytes
      leaves.append((name[2:], tuple(x.shape), str(x.dtype), spec_text(sh), nbytes,
                     int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize))
    else:
      optimizer += nbytes
  leaves.sort(key=lambda r: -r[5])
  replicated = [r for r in leaves if r[3] == 'replicated' and r[5] >= 2 ** 20]
  return {'param_bytes': params, 'optimizer_bytes': optimizer,
          'params': {r[0]: {'shape': r[1], 'dtype': r[2], 'spec': r[3], 'bytes_per_chip': r[4]}
                     for r in leaves},
          'largest_params': [r[0] for r in leaves[:5]],
          'replicated_params': [r[0] for r in replicated]}


_DUMP = {'dir': None}


def hlo_text(compiled) -> str:
  """The compiled module as text, large constants printed: a splash kernel's block mask is
  a constant operand of the call, and the blocks it keeps are what the kernel computes."""
  if _hlo_print is not None:
    try:
      options = _hlo_print.HloPrintOptions()
      options.print_large_constants = True
      return compiled.runtime_executable().hlo_modules()[0].to_string(options)
    except Exception:  # pylint: disable=broad-except
      pass
  return compiled.as_text()


def _program_report(compiled, lowered_s: float, compile_s: float, num_devices: int,
                    chip, name: str = '', grouped_rows: int = 0) -> dict:
  text = hlo_text(compiled)
  if _DUMP['dir'] and name:
    os.makedirs(_DUMP['dir'], exist_ok=True)
    with open(os.path.join(_DUMP['dir'], f'{name}.hlo.txt'), 'w', encoding='utf-8') as f:
      f.write(text)
  hlo = analyze_hlo(text, num_devices, grouped_rows)
  return {'lower_s': round(lowered_s, 2), 'compile_s': round(compile_s, 2),
          'memory': _memory(compiled), 'cost_analysis': _cost(compiled),
          'hlo_matmul_flops': hlo.matmul_flops, 'kernel_flops': hlo.kernel_flops,
          'hbm_bytes': hlo.hbm_bytes, 'hbm_bytes_once': hlo.hbm_bytes_once,
          'collectives': hlo.collectives, 'kernel_calls': hlo.kernel_calls,
          'kernels': hlo.kernels, 'unknown_trip_counts': hlo.unknown_trip_counts,
          'conditionals': hlo.conditionals, 'priced': pricing.price_step(hlo, chip)}


# Compiled results by the lowered program: JAX's persistent compilation cache cannot read a
# compile-only executable back ("PjRtCompiler must be constructed with a Client"), so the
# figures themselves are kept, keyed by everything that decides the compiled program.
_CACHE = {'dir': None}
_ANALYSIS_VERSION = '7'  # bump when the figures read from a compiled program change


def _libtpu_version() -> str:
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return ''


def _cache_key(lowered_text: str, program: str, topo: Topology) -> str:
  h = hashlib.sha256()
  for part in (lowered_text, program, topo.name, str(topo.num_slices), topo.chip.platform,
               jax.__version__, _libtpu_version(), os.environ.get('XLA_FLAGS', ''),
               os.environ.get('LIBTPU_INIT_ARGS', ''), _ANALYSIS_VERSION):
    h.update(part.encode())
    h.update(b'\0')
  return h.hexdigest()[:40]


def _compiled(fn, args, program: str, topo: Topology, num_devices: int, log,
              hint: str = '', grouped_rows: int = 0) -> dict:
  """Lowers and compiles `fn` (or reads a cached result of the same program) -> its report.
  grouped_rows: the rows a grouped-matmul call receives on average (_grouped_rows)."""
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  lower_s = time.perf_counter() - t0
  path = None
  if _CACHE['dir']:
    path = os.path.join(_CACHE['dir'], _cache_key(lowered.as_text(), program, topo) + '.json')
    if os.path.exists(path) and not _DUMP['dir']:
      with open(path, encoding='utf-8') as f:
        rep = json.load(f)
      rep.update(lower_s=round(lower_s, 2), cached=True)
      log(f'{program}: lowered in {lower_s:.1f} s; compile read from the cache (it took '
          f'{rep["compile_s"]:.1f} s)')
      return rep
  t1 = time.perf_counter()
  compiled = _compile(lowered, program, topo, hint)
  compile_s = time.perf_counter() - t1
  log(f'{program}: lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s')
  rep = _program_report(compiled, lower_s, compile_s, num_devices, topo.chip, program,
                        grouped_rows)
  if path:
    os.makedirs(_CACHE['dir'], exist_ok=True)
    tmp = f'{path}.{os.getpid()}.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      json.dump(rep, f)
    os.replace(tmp, path)
  rep['cached'] = False
  return rep


def _grouped_rows(config, batch: dict, microbatches: int) -> int:
  """The (token, expert) rows an MoE layer's grouped matmul on one chip computes on average
  in one microbatch: the chip's tokens times the experts per token. Each chip routes that
  many rows and, over the chips, receives as many as it sends; the exchange's buffers are
  larger (the worst case, or the capacity factor). 0 without MoE layers."""
  if config.model.mlp != 'moe':
    return 0
  tokens = batch['tokens']
  b, t = tokens.sharding.shard_shape(tokens.shape)
  return b * t // microbatches * config.model.moe.num_experts_per_tok


def _train_and_eval(config, devices, topo, programs, log) -> dict:
  mesh = sharding.make_mesh(config, devices)
  rules = sharding.rules_of(config)
  out = {'mesh': dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape)))}
  with sharding.use_mesh(mesh, rules):
    abstract = nnx.eval_shape(lambda: create_model_and_optimizer(config))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = sharding.state_shardings(abstract_state, mesh)
  abstract_state = abstract_like(abstract_state, shardings)
  out.update(_state_summary(abstract_state, shardings))
  hint = 'largest parameters per chip (x3 with the Adam moments): ' + ', '.join(
      f'{p} {out["params"][p]["bytes_per_chip"] / GIB:.2f} GiB' for p in out['largest_params'][:3])
  batch, batch_shardings = _batch_structs(config, mesh)
  out['batch_bytes'] = sum(shard_bytes(x) for x in batch.values())
  rep = sharding.replicated(mesh)
  args = steps.StepArgs.from_config(config)
  with sharding.use_mesh(mesh, rules):
    if 'train' in programs:
      # the jit of steps.setup: explicit shardings, the state donated
      fn = jax.jit(functools.partial(steps.train_step, args, graphdef),
                   in_shardings=(shardings, batch_shardings), out_shardings=(shardings, rep),
                   donate_argnums=0)
      out['train'] = _compiled(fn, (abstract_state, batch), 'train', topo, len(devices), log,
                               hint, _grouped_rows(config, batch, config.train.grad_accum))
    if 'eval' in programs:
      fn = jax.jit(functools.partial(steps.eval_step, args, graphdef),
                   in_shardings=(shardings, batch_shardings, rep), out_shardings=rep)
      vocab = jax.ShapeDtypeStruct((config.model.vocab_size,), jnp.int32, sharding=rep)
      out['eval'] = _compiled(fn, (abstract_state, batch, vocab), 'eval', topo, len(devices),
                              log, hint, _grouped_rows(config, batch, 1))
  return out


def _decode(config, device, topo, batch: int, new_tokens: int, log) -> dict:
  """The decoder's program (prefill + while loop) on one chip, as Decoder.compile builds it."""
  layout = 'bskh'  # decode_ops.default_cache_layout() off CPU
  args = ModelArgs.from_config(config)
  weights = 'bfloat16' if args.dtype == jnp.bfloat16 else 'float32'
  abstract = nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0)).for_decoding(layout))
  graphdef, params = nnx.split(abstract)
  if weights != 'float32':
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
                          if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  leaves, treedef = jax.tree.flatten(params)
  prompt = decode_prompt_len(config)
  prog = decoder_lib.Program(batch, decoder_lib.bucket(prompt), decoder_lib.bucket(new_tokens),
                             args.mtp_depth, greedy=True, layout=layout, weights=weights)
  one = jax.sharding.SingleDeviceSharding(device)

  def struct(x):
    return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=one)

  sampling = Sampling(np.float32(1.0), np.int32(0), np.float32(1.0), np.bool_(False),
                      use_top_k=False, use_top_p=False)
  example = ([jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in leaves],
             np.zeros((batch, prog.prompt_len), np.int32), np.zeros((batch,), np.int32),
             np.zeros((batch,), np.int32), np.int32(1), sampling, np.int32(0), np.float32(0))
  abstract_in = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else struct(x),
                             example)
  # the function Decoder.compile jits, given abstract weights
  fn = jax.jit(functools.partial(decoder_lib.decode_program, prog, graphdef, treedef))
  rep = _compiled(fn, abstract_in, 'decode', topo, 1, log)
  rep.update({'batch': batch, 'prompt_len': prog.prompt_len, 'max_new': prog.max_new,
              'num_drafts': prog.num_drafts, 'weights': weights,
              'param_bytes': sum(shard_bytes(x) for x in abstract_in[0])})
  return rep


def compile_report(config, topo: Topology, programs=PROGRAMS, decode_batch: int = 1,
                   decode_tokens: int = 64, devices=None, log=lambda s: None,
                   dump_dir: str | None = None, cache_dir: str | None = None) -> dict:
  """Compiles `programs` of `config` for `topo` and returns the per-chip report (a dict).

  dump_dir: also write each compiled program's HLO text there (<program>.hlo.txt; then
  nothing is read from the cache). cache_dir: keep each program's figures there, keyed by
  the lowered program, the topology and the compiler versions; a rerun reads them back."""
  _DUMP['dir'], _CACHE['dir'] = dump_dir, cache_dir
  bad = [p for p in programs if p not in PROGRAMS]
  if bad or not programs:
    raise RequestError(f'programs must be some of {PROGRAMS}, got {tuple(programs)}')
  config = _target_config(config, topo.chip.platform)
  devices = topology_devices(topo) if devices is None else devices
  validate(config, len(devices))
  t0 = time.perf_counter()
  with traced_for(topo.chip.platform), no_jax_cache():
    report = {'topology': topo.name, 'num_slices': topo.num_slices, 'chips': len(devices),
              'device_kind': devices[0].device_kind, 'chip': dataclasses.asdict(topo.chip)}
    if 'train' in programs or 'eval' in programs:
      report.update(_train_and_eval(config, devices, topo, programs, log))
    if 'decode' in programs:
      report['decode'] = _decode(config, devices[0], topo, decode_batch, decode_tokens, log)
  report['compile_s'] = round(time.perf_counter() - t0, 2)
  figures.add_figures(report, config, topo)
  return report


