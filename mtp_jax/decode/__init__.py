"""Self-speculative decoding: the MTP heads draft, the model verifies, losslessly.

- decoder.py: `Decoder(model).generate(prompts, max_new_tokens, ...)`, one compiled
  `lax.while_loop` per static shape, and its `DecodeResult`.
- sampling.py: `Sampling` (temperature, top-k, top-p) and the acceptance rule.
- tree.py: tree drafting (`Decoder(model, tree='3,2,1')`): tree windows, acceptance.
- generate.py: `decode_workdir`, decoding with a training workdir's newest model.
"""
from mtp_jax.decode.decoder import Decoder, DecodeResult, check_request, clear_compiled
from mtp_jax.decode.generate import decode_workdir, read_prompts, token_sources
from mtp_jax.decode.sampling import Sampling

__all__ = ['DecodeResult', 'Decoder', 'Sampling', 'check_request', 'clear_compiled',
           'decode_workdir', 'read_prompts', 'token_sources']
