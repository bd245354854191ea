"""A scratch MTP head kind: independent heads on h^0."""
import mtp_jax.model.mtp as mtp


class ScratchHead(mtp.ParallelHead):
  """Parallel heads under another name."""
