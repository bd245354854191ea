"""The decode iteration's cost model for a TPU or GPU target, priced by its compiler.

The same passes cost.py times on the running backend (decoder.pass_functions: the verify
pass and its logits, one MTP block, one head's logits, each over a number of rows), here
compiled for one chip of the target as the decode program is (programs._decode: the
'bskh' cache layout, bf16 weights for a bf16 model) and priced op by op by pricing.py (the
TPU compiler's estimated cycles; on a GPU the roofline of each op, a lower bound). The
acceptance, cache moves and bookkeeping of an iteration are left unpriced (the
IterationCost's constants stay 0), as is the attention over the cache beyond what these
passes read at the prompt bucket's position. `pick` hands the priced tables and a
model's measured acceptance rates to the picker.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

import mtp_jax.train.aot.pricing as pricing
import mtp_jax.train.aot.programs as programs
from mtp_jax.config.readers import decode_prompt_len
from mtp_jax.data import tokenizers
from mtp_jax.decode import cost as cost_lib
from mtp_jax.decode import decoder as decoder_lib
from mtp_jax.decode import picker as picker_lib
from mtp_jax.model.args import ModelArgs
from mtp_jax.model.mtp import MTPModel
from mtp_jax.train.aot.devices import Topology, no_jax_cache, topology_devices, traced_for
from mtp_jax.train.aot.hlo import analyze_hlo

ROWS = (1, 2, 4, 8, 16, 32, 64)  # the rows priced; an accelerator's cost is smooth in rows


def _grid(max_rows: int) -> tuple:
  return tuple(r for r in ROWS if r < max_rows) + (max_rows,)


def priced_cost(config, topo: Topology, *, batch: int = 1, new_tokens: int = 64,
                max_rows: int = picker_lib.MAX_ROWS, depth: int | None = None,
                log=lambda s: None) -> cost_lib.IterationCost:
  """The IterationCost of `config`'s model on one chip of `topo`, from the compiler."""
  config = config.copy_and_resolve_references()
  tokenizers.resolve_vocab_size(config)
  device = topology_devices(topo)[0]
  one = jax.sharding.SingleDeviceSharding(device)
  t0 = time.perf_counter()
  with traced_for(topo.chip.platform), no_jax_cache():
    args = ModelArgs.from_config(config)
    depth = depth or cost_lib.max_depth(args)
    layout = 'bskh'  # decode_ops.default_cache_layout() off CPU
    weights = 'bfloat16' if args.dtype == jnp.bfloat16 else 'float32'
    abstract = nnx.eval_shape(lambda: MTPModel(args, rngs=nnx.Rngs(0)).for_decoding(layout))
    graphdef, params = nnx.split(abstract)
    if weights != 'float32':
      params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16)
                            if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x,
                            params)
    leaves, treedef = jax.tree.flatten(params)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in leaves]
    prompt = decode_prompt_len(config)
    prog = decoder_lib.Program(batch, decoder_lib.bucket(prompt), decoder_lib.bucket(new_tokens),
                               depth, greedy=True, layout=layout, weights=weights)
    caches = jax.eval_shape(functools.partial(decoder_lib.pass_caches, graphdef, treedef, prog),
                            leaves)
    caches = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), caches)
    tables = {}
    for name, make, top in zip(('verify', 'block', 'logits'),
                               decoder_lib.pass_functions(graphdef, treedef, prog),
                               (max_rows, max_rows + depth + 1, max_rows)):
      tables[name] = {}
      for rows in _grid(top):
        fn = jax.jit(functools.partial(make(rows), reps=1))
        compiled = fn.lower(leaves, caches).compile()
        hlo = analyze_hlo(programs.hlo_text(compiled), 1)
        tables[name][str(rows)] = pricing.price_step(hlo, topo.chip)['step_s']
      log(f'{name}: ' + ' '.join(f'{r}:{1e3 * t:.3f}' for r, t in tables[name].items()) + ' ms')
  basis = 'estimated cycles' if topo.chip.platform == 'tpu' else 'roofline'
  log(f'priced in {time.perf_counter() - t0:.0f} s')
  return cost_lib.IterationCost(**tables, batch=batch,
                                source=f'compiler ({basis}): {topo.name}, one chip')


def pick(config, topo: Topology, acceptance, *, batch: int = 1, new_tokens: int = 64,
         max_rows: int = picker_lib.MAX_ROWS, log=lambda s: None) -> picker_lib.Choice:
  """The picker's shape for `config`'s model on `topo` under the given acceptance rates."""
  cost = priced_cost(config, topo, batch=batch, new_tokens=new_tokens, max_rows=max_rows,
                     depth=acceptance.depths, log=log)
  return picker_lib.choose(acceptance, cost, max_depth=acceptance.depths, max_rows=max_rows)
