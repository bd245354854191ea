"""Self-speculative decoding: the MTP heads draft, the model verifies, losslessly.

- decoder.py: `Decoder(model).generate(prompts, max_new_tokens, ...)`, one compiled
  `lax.while_loop` per static shape, and its `DecodeResult`.
- sampling.py: `Sampling` (temperature, top-k, top-p) and the acceptance rule.
- tree.py: tree drafting (`Decoder(model, tree='3,2,1')`): tree windows, acceptance.
- generate.py: `decode_workdir`, decoding with a training workdir's newest model.

Public names load lazily (mtp_jax/exports.py), as in every sub-package.
"""
from mtp_jax.exports import lazy

__getattr__, __dir__, __all__ = lazy(__name__, {
    'DecodeResult': 'decoder',
    'Decoder': 'decoder',
    'Sampling': 'sampling',
    'check_request': 'decoder',
    'clear_compiled': 'decoder',
    'decode_workdir': 'generate',
    'read_prompts': 'generate',
    'token_sources': 'generate',
})
