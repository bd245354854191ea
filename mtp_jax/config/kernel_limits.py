"""The attention kernels' limits, readable before JAX starts: the config checks refuse a
shape a kernel cannot take, and the kernels' callers (model/attention.py) ask again while
tracing."""
from __future__ import annotations

ATTENTION_CORES = ('auto', 'blocked', 'splash', 'triton', 'xla')
# The Triton kernel's blocks by padded head width (the next power of two): forward queries x
# keys, then the backward kernels' (dkv: queries x keys, dq: queries x keys), so that the
# tiles fit an H100's shared memory (128 x 128 forward at width 256 asks for 320 KiB of its
# 227). Up to width 128 the backward takes the shapes of Triton's fused-attention tutorial
# (dkv 32 x 128: a key block accumulates over small query blocks; dq 128 x 32), not the
# kernel's 32 x 32 defaults, which re-read q and do four times per key. The dkv key block
# must equal the dq query block (the fused backward splits both lengths alike). Widths past
# the last row were never compiled.
TRITON_BLOCKS = ((128, (128, 128, 32, 128, 128, 32)), (256, (128, 64, 32, 64, 64, 32)),
                 (512, (64, 32, 32, 32, 32, 32)))


def triton_blocks(head_width: int) -> tuple | None:
  """(block_q, block_k, block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq) of the Triton
  kernel for q / k heads this wide (TRITON_BLOCKS), or None."""
  padded = 1 << max(head_width - 1, 0).bit_length()
  return next((blocks for width, blocks in TRITON_BLOCKS if padded <= width), None)


def attention_kernel_problem(core: str, seq_len: int, block_q: int, block_kv: int,
                             head_width: int = 0) -> str:
  """One line saying why attention core `core` cannot take sequences of seq_len with
  these splash blocks and q / k heads head_width wide, or '' when it can ('auto' and the
  non-kernel cores: always '').

  splash: each block (at most T) must divide T and be a multiple of 128, the kernel's
  lane width (its key blocks must be; the query blocks tile the segment-id rows alike).
  triton: T must be a multiple of each of its blocks (at most T); heads up to 512 wide."""
  if core == 'splash':
    for name, block in (('attention_block_q', block_q), ('attention_block_kv', block_kv)):
      b = min(block, seq_len)
      if seq_len % b or b % 128:
        return (f'model.attention_core=splash needs data.seq_len ({seq_len}) to be a multiple '
                f'of model.{name} ({block}) or of 128 if shorter, and that block a multiple '
                'of 128; change data.seq_len or the block, or use attention_core=blocked / xla')
  if core == 'triton':
    blocks = triton_blocks(head_width)
    if blocks is None:
      return (f'model.attention_core=triton takes query/key heads up to {TRITON_BLOCKS[-1][0]} '
              f'wide (the widest compiled for an H100), got {head_width}; use '
              'attention_core=xla')
    for block in blocks:
      if seq_len % min(block, seq_len):
        return (f'model.attention_core=triton needs data.seq_len ({seq_len}) to be a multiple '
                f'of {block} (the Pallas GPU kernel\'s block) when longer; change '
                'data.seq_len or use attention_core=xla')
  return ''
