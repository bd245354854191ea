"""The model: a decoder-only transformer trunk with multi-token-prediction (MTP) modules.

- mtp.py: `ModelArgs` (the model's hyper-parameters from a config), `MTPModel` and its MTP
  heads (`SequentialMTP`, chained as in DeepSeek-V3, and `ParallelHead`).
- kind_classes.py: the classes of the kinds by their config names (`ATTENTION_KINDS`,
  `MLP_KINDS`, `MTP_KINDS`), as mtp_jax/config/kinds.py's table names them.
- layers.py, attention.py, mla.py: norms, RoPE, feed-forward blocks, grouped-query and
  multi-head latent attention.
- moe.py, moe_exchange.py: the mixture-of-experts block and its token exchange.
- decode_ops.py: the KV-cache operations the decoder calls.

Nothing here reads or writes checkpoints (mtp_jax.checkpoint) or builds an optimizer
(mtp_jax.train_state).
"""
import warnings as _warnings

from mtp_jax.data import tokenizers as _tokenizers
from mtp_jax.model.mtp import (
  ATTENTION_KINDS,
  MAX_DRAFTS,
  MLP_KINDS,
  MTP_KINDS,
  ModelArgs,
  MTPModel,
  ParallelHead,
  SequentialMTP,
  SharedHead,
  count_params,
)

__all__ = ['ATTENTION_KINDS', 'MAX_DRAFTS', 'MLP_KINDS', 'MTP_KINDS', 'MTPModel', 'ModelArgs',
           'ParallelHead', 'SequentialMTP', 'SharedHead', 'count_params']


def __getattr__(name: str):
  # The flat layout's mtp_jax.model.resolve_vocab_size returned the int; the function of
  # that name in mtp_jax.data now fills config.model.vocab_size and returns the config.
  if name == 'resolve_vocab_size':
    _warnings.warn('mtp_jax.model.resolve_vocab_size moved to mtp_jax.data.model_vocab_size '
                   '(the int); mtp_jax.data.resolve_vocab_size now sets config.model.vocab_size '
                   'and returns the config', DeprecationWarning, stacklevel=2)
    return _tokenizers.model_vocab_size
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
