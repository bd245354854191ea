"""A scratch attention kind: GQA under another name."""
import mtp_jax.model.layers as layers
from mtp_jax.config import kinds


class ScratchAttention(layers.Attention):
  """GQA under another name: the place to change the call, the cache or the decode path."""
  facts = kinds.ATTENTION['scratch']
