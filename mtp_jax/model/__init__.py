"""The model: a decoder-only transformer trunk with multi-token-prediction (MTP) modules.

- args.py: `ModelArgs`, the model's hyper-parameters from a config.
- blocks.py: the attention and MLP kinds of each layer, and running a stack of blocks
  (remat, scan).
- heads.py: the MTP head kinds (`SequentialMTP`, chained as in DeepSeek-V3, `ParallelHead`,
  the token-order head) and the output head they share.
- mtp.py: `MTPModel`, the trunk and its MTP modules, trained and decoded.
- kind_classes.py: the classes of the kinds by their config names (`ATTENTION_KINDS`,
  `MLP_KINDS`, `MTP_KINDS`), as mtp_jax/config/kinds.py's table names them.
- layers.py, attention.py, mla.py: norms, RoPE, feed-forward blocks, grouped-query and
  multi-head latent attention.
- moe.py, moe_exchange.py: the mixture-of-experts block and its token exchange.
- decode_ops.py: the KV-cache operations the decoder calls.

Nothing here reads or writes checkpoints (mtp_jax.checkpoint), builds an optimizer
(mtp_jax.train_state) or reads a tokenizer (mtp_jax.data). Public names load lazily
(mtp_jax/exports.py), as in every sub-package.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'ATTENTION_KINDS': 'kind_classes',
    'MAX_DRAFTS': 'heads',
    'MLP_KINDS': 'kind_classes',
    'MTPModel': 'mtp',
    'MTP_KINDS': 'kind_classes',
    'ModelArgs': 'args',
    'ParallelHead': 'heads',
    'SequentialMTP': 'heads',
    'SharedHead': 'heads',
    'count_params': 'mtp',
})
