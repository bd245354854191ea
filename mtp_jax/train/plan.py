"""What `mtp-train --print_config` shows: the config a run would train, resolved as the
trainer resolves it, and where it would run (devices, mesh, batch split), with nothing
compiled and nothing written."""
from __future__ import annotations

import json
import math
import os

import jax

import mtp_jax.train.metrics as metrics_lib
from mtp_jax.config.mesh import resolved_mesh_axes
from mtp_jax.config.validation import staged_layers
from mtp_jax.train.start import init_source, resolve_config
from mtp_jax.train_state.init_from import InitFrom


def describe(config, workdir: str, init_from: str | InitFrom | None = None) -> str:
  """The resolved config as JSON (the run's config.json), then the plan, one fact a line."""
  devices = jax.devices()
  source = init_source(init_from)
  changes = resolve_config(config, source, len(devices))
  mesh = resolved_mesh_axes(config.mesh, len(devices))
  d, t = config.data, config.train
  shards = mesh['data'] * mesh['fsdp']
  checkpoints = os.path.join(workdir, 'checkpoints')
  lines = [
      json.dumps(json.loads(config.to_json_best_effort()), indent=2),
      f'workdir: {workdir}' + (' (has checkpoints: the run resumes from its newest)'
                               if os.path.isdir(checkpoints) and os.listdir(checkpoints)
                               else ' (a new run)'),
      metrics_lib.devices_line(devices, mesh, jax.process_count()),
      'mesh: ' + ' x '.join(f'{k} {v}' for k, v in mesh.items()),
      f'batch: {d.batch_size} sequences of {d.seq_len} tokens a step, '
      f'{d.batch_size // shards} per data x fsdp shard'
      + (f' in {t.grad_accum} micro-batches' if t.grad_accum > 1 else ''),
      *([f"context: each sequence in {mesh['context']} shards of {d.seq_len // mesh['context']} "
         'tokens (load-balanced causal order)'] if mesh['context'] > 1 else []),
      f'steps: {t.steps} ({t.steps * d.batch_size * d.seq_len:,} tokens), '
      f'M = {config.model.mtp.depth} MTP depths, {math.prod(mesh.values())} devices',
  ]
  if mesh['stage'] > 1:
    lines.append(pipeline_line(config, mesh['stage']))
  if changes:
    lines.append(source.describe(changes))
  return '\n'.join(lines)


def pipeline_line(config, stages: int) -> str:
  """The pipeline of a mesh with stages: layers per stage, microbatches and the bubble."""
  m = config.model
  staged = staged_layers(m)
  micro = m.get('pipeline_microbatches', 0) or stages
  dense = m.n_layers - staged
  return (f'pipeline: {stages} stages of {staged // stages} layers'
          + (f' after {dense} dense first layers on every stage' if dense else '')
          + f', {micro} microbatches, GPipe schedule, bubble (S - 1) / (N + S - 1) = '
          f'{(stages - 1) / (micro + stages - 1):.3f}; embedding, MTP modules and output '
          f'head on every stage')
