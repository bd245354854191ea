"""The kinds a config may name, each with its facts: the one table, readable before JAX starts.

`ATTENTION` (model.attention, model.mtp.block_attention), `MLP` (model.mlp,
model.mtp.block_mlp) and `MTP_HEADS` (model.mtp.kind) map a config value to the model
class that implements it (`cls`, a dotted path that mtp_jax/model/kind_classes.py imports on first
use, so this module needs nothing of the model) and to the facts that the config checks,
the model and the export layouts read. The config accepts exactly these names and the
model builds exactly these classes: a new kind is its class and one entry here
(docs/development.md, "Add a block or MTP-head kind").
"""
from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from typing import Any

import ml_collections


@dataclasses.dataclass(frozen=True)
class AttentionFacts:
  """An attention kind: its class and what is known of it without building it."""
  cls: str  # dotted path of the model class (layers.AttentionKind)
  label: str  # how messages name it
  # model arguments (ModelArgs, or args_view(config.model)) -> (query/key, value) width of
  # one head; the softmax scale is 1 / sqrt(query/key width)
  head_widths: Callable[[Any], tuple[int, int]]
  takes_rope_scaling: bool  # its RoPE follows model.rope_scaling
  takes_qkv_bias: bool  # model.attention_bias adds q/k/v biases
  hf_layouts: tuple[str, ...] = ()  # the export layouts that hold it (interop/layouts.py)
  # model arguments -> (query and key heads RoPE rotates per token, the rotated width)
  rotated: Callable[[Any], tuple[int, int]] | None = None

  def softmax_scale(self, args) -> float:
    """1 / sqrt(query/key head width): the scale of q k^T before the softmax."""
    return 1.0 / math.sqrt(self.head_widths(args)[0])


@dataclasses.dataclass(frozen=True)
class MLPFacts:
  """An MLP kind: its class and the export layouts that hold it."""
  cls: str  # dotted path of the model class (layers.MLPKind)
  label: str
  hf_layouts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class HeadFacts:
  """An MTP head kind (model.mtp.kind); what it reads, drafts and costs, its class says
  (chained, max_drafts, flops_per_token, has_block, hf_layer)."""
  cls: str  # dotted path of the model class
  max_depth: int = 0  # the most depths it may have (0: any)
  # it predicts tokens at offsets: model.mtp.target_offsets, loss.mtp_targets other than
  # 'data', stop_gradient and freeze_trunk apply to it
  predicts_tokens: bool = True
  # one module may serve every depth (model.mtp.share_modules): chained, it reads its own
  # output
  shares_modules: bool = False


ATTENTION = {
    'gqa': AttentionFacts('mtp_jax.model.layers.Attention', 'GQA',
                          lambda a: (a.head_dim, a.head_dim), takes_rope_scaling=True,
                          takes_qkv_bias=True, hf_layouts=('llama', 'mimo'),
                          rotated=lambda a: (a.n_heads + a.n_kv_heads, a.head_dim)),
    'mla': AttentionFacts('mtp_jax.model.mla.MLAttention', 'MLA',
                          lambda a: (a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim),
                          takes_rope_scaling=False, takes_qkv_bias=False,
                          hf_layouts=('deepseek_v3',),
                          rotated=lambda a: (a.n_heads + 1, a.qk_rope_head_dim)),
}
MLP = {
    'dense': MLPFacts('mtp_jax.model.layers.MLP', 'dense SwiGLU',
                      hf_layouts=('llama', 'mimo', 'deepseek_v3')),
    'moe': MLPFacts('mtp_jax.model.moe.MoE', 'MoE', hf_layouts=('deepseek_v3',)),
}
MTP_HEADS = {
    'sequential': HeadFacts('mtp_jax.model.heads.SequentialMTP', shares_modules=True),
    'parallel': HeadFacts('mtp_jax.model.heads.ParallelHead'),
    'top': HeadFacts('mtp_jax.model.heads.TokenOrderHead', max_depth=1, predicts_tokens=False),
}

def target_offsets(kind: str, depth: int, offsets=()) -> tuple:
  """(1, o_1, ..., o_M): how far ahead each head of an M-depth model of head `kind`
  predicts, the main head first; `offsets` are model.mtp.target_offsets (() = k + 1). A
  kind that predicts no single token (TOP ranks them) ranks from the next token: offset 1
  (it cannot draft)."""
  if not MTP_HEADS[kind].predicts_tokens:
    return (1,) * (depth + 1)
  return (1,) + (tuple(int(o) for o in offsets) or tuple(range(2, depth + 2)))


def mtp_module_count(depth: int, share_modules: bool) -> int:
  """How many MTP modules hold parameters: one that every depth runs under
  model.mtp.share_modules, else one per depth."""
  return min(depth, 1) if share_modules else depth


# The names alone, as the config checks list them.
ATTENTION_KINDS = tuple(ATTENTION)
MLP_KINDS = tuple(MLP)
MTP_KINDS = tuple(MTP_HEADS)
MOE_DISPATCHES = ('auto', 'ragged', 'blocks', 'gmm')  # model.moe.dispatch (moe.DISPATCHES)
MOE_EXCHANGES = ('all_to_all', 'all_gather')  # model.moe.exchange (moe_exchange.EXCHANGES)


@dataclasses.dataclass(frozen=True)
class DataSourceFacts:
  """A data.source (mtp_jax/data/user_data.py reads each but tfds): what data.path is."""
  takes_path: bool = True  # False: a TFDS dataset, named by data.dataset, no data.path
  suffix: str = ''  # records: data.path is one file of this suffix or a folder of them
  # else data.path is a folder: the error when it is not one ({root}: the path)
  not_a_folder: str = ''


DATA = {
    'tfds': DataSourceFacts(takes_path=False),
    'files': DataSourceFacts(not_a_folder='data.path: corpus root {root!r} is not a readable '
                                          'directory'),
    'jsonl': DataSourceFacts(suffix='.jsonl'),
    'parquet': DataSourceFacts(suffix='.parquet'),
    'hf_disk': DataSourceFacts(not_a_folder='data.path {root!r} is not a directory (data.source '
                                            'hf_disk reads what datasets.Dataset.save_to_disk '
                                            'wrote)'),
}
DATA_SOURCES = tuple(DATA)


def args_view(model: ml_collections.ConfigDict) -> types.SimpleNamespace:
  """config.model under the model arguments' flat names (model.mla.* and model.moe.*
  lifted to the top), for the facts' functions before the model is built."""
  flat = {k: v for k, v in model.items() if not isinstance(v, ml_collections.ConfigDict)}
  for section in ('mla', 'moe'):
    if section in model:
      flat.update(model[section].items())
  return types.SimpleNamespace(**flat)
