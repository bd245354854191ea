"""The model: a decoder-only transformer trunk with multi-token-prediction (MTP) modules.

- mtp.py: `ModelArgs` (the model's hyper-parameters from a config), `MTPModel` and its MTP
  heads (`SequentialMTP`, chained as in DeepSeek-V3, and `ParallelHead`).
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
    'ATTENTION_KINDS': 'mtp',
    'MAX_DRAFTS': 'mtp',
    'MLP_KINDS': 'mtp',
    'MTPModel': 'mtp',
    'MTP_KINDS': 'mtp',
    'ModelArgs': 'mtp',
    'ParallelHead': 'mtp',
    'SequentialMTP': 'mtp',
    'SharedHead': 'mtp',
    'count_params': 'mtp',
})
