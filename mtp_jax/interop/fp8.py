"""DeepSeek-V3's FP8 weights: float8_e4m3fn blocks with one float32 `weight_scale_inv` each.

The release (README_WEIGHTS.md of github.com/deepseek-ai/DeepSeek-V3) stores the projection
weights of its decoder layers this way, 128 x 128 blocks per scale entry; norms, the router
(mlp.gate), eh_proj, the embedding and the heads stay in a wide type.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 128  # weight rows and columns per weight_scale_inv entry
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
SCALE_SUFFIX = '_scale_inv'  # `<name>_scale_inv` beside each FP8 `<name>`
PROJECTIONS = ('q_proj', 'q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj',
               'gate_proj', 'up_proj', 'down_proj')


def in_release(name: str) -> bool:
  """Whether the release stores this tensor as FP8: a projection weight of a decoder layer
  (attention, dense MLP, experts, shared experts), not mlp.gate, eh_proj or the heads."""
  parts = name.split('.')
  return name.startswith('model.layers.') and parts[-1] == 'weight' and parts[-2] in PROJECTIONS


def quantization_config() -> dict:
  """config.json's quantization_config of an FP8 export, as the release's."""
  return {'activation_scheme': 'dynamic', 'fmt': 'e4m3', 'quant_method': 'fp8',
          'weight_block_size': [BLOCK, BLOCK]}


def scale_shape(shape: tuple, block: int = BLOCK) -> tuple:
  """weight_scale_inv's shape for an [O, I] weight (the last blocks may be partial)."""
  return tuple(-(-n // block) for n in shape)


def dequantize(weight_OxI: np.ndarray, scale_inv_ObxIb: np.ndarray,
               block: int = BLOCK) -> np.ndarray:
  """float32 weight: block [p, q] times scale_inv[p, q], as DeepSeek's `weight_dequant`
  (inference/kernel.py). ValueError when the scale's shape does not fit the weight."""
  o, i = weight_OxI.shape
  want = scale_shape((o, i), block)
  if tuple(scale_inv_ObxIb.shape) != want:
    raise ValueError(f'weight_scale_inv has shape {tuple(scale_inv_ObxIb.shape)}, expected '
                     f'{want} for a {tuple(weight_OxI.shape)} weight in {block} x {block} blocks')
  scale = np.repeat(np.repeat(scale_inv_ObxIb.astype(np.float32), block, 0), block, 1)
  return weight_OxI.astype(np.float32) * scale[:o, :i]


def quantize(w_OxI: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
  """(float8_e4m3fn weight, float32 weight_scale_inv): each block's largest |w| maps to 448.

  A partial block is zero-padded before its scale is taken (README_WEIGHTS.md), which
  leaves its max |w| unchanged; an all-zero block gets scale 1.
  """
  o, i = w_OxI.shape
  p, q = scale_shape((o, i), block)
  padded = np.zeros((p * block, q * block), np.float32)
  padded[:o, :i] = w_OxI
  amax_ObxIb = np.abs(padded.reshape(p, block, q, block)).max(axis=(1, 3))
  scale_ObxIb = np.where(amax_ObxIb > 0, amax_ObxIb / E4M3_MAX, 1.0).astype(np.float32)
  full = np.repeat(np.repeat(scale_ObxIb, block, 0), block, 1)[:o, :i]
  return (w_OxI / full).astype(ml_dtypes.float8_e4m3fn), scale_ObxIb
