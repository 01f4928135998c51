"""Rotary position embeddings, with the RoPE scalings of HF checkpoints.

`scaling` is `ModelConfig.rope_scaling`: () for plain RoPE, else the HF
`rope_parameters` without `rope_theta`, as sorted (key, value) pairs, e.g.
Llama 3.1's (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor",
1.0), ("original_max_position_embeddings", 8192), ("rope_type", "llama3")).
The inverse frequencies follow transformers' `ROPE_INIT_FUNCTIONS` in float32:

- `linear` (position interpolation): inv_freq / factor;
- `llama3`: low frequencies (wavelength > original / low_freq_factor) divided
  by factor, high ones kept, a smooth ramp between (Llama 3.1 report, §3.3);
- `yarn` (Peng et al. 2023, arXiv 2309.00071): per-frequency ramp between
  interpolation and extrapolation, and cos/sin scaled by the attention factor
  0.1 ln(factor) + 1 (or its mscale variants);
- `longrope` (Phi-3, LongRoPE, arXiv 2402.13753): inv_freq / short_factor[i]
  while the batch's length L = max(position) + 1 is within
  original_max_position_embeddings, / long_factor[i] beyond it (per call, as
  transformers' forward), cos/sin scaled by sqrt(1 + ln(factor) /
  ln(original)) (factor: max_position_embeddings / original unless given);
- `dynamic` (NTK): base theta * (factor * L / max_pos - (factor - 1))
  ^ (d / (d - 2)) once the batch's length L = max(position) + 1 exceeds
  max_position_embeddings, as transformers' forward does (it recomputes per
  call; it also keeps the largest L seen, which a stateless layer cannot);
- `proportional` (Gemma 4's full layers): the first
  int(partial_rotary_factor * head_dim / 2) frequencies of plain RoPE over
  the whole head, the rest 0 (those channel pairs pass through), all
  divided by factor.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

# rope_type -> the keys it reads (besides rope_type) and which are required.
ROPE_KEYS = {
    "linear": ({"factor"}, {"factor"}),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"},
               {"factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"}),
    "yarn": ({"factor", "attention_factor", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "original_max_position_embeddings",
              "max_position_embeddings", "truncate"},
             {"original_max_position_embeddings"}),
    "dynamic": ({"factor", "max_position_embeddings"},
                {"factor", "max_position_embeddings"}),
    "longrope": ({"short_factor", "long_factor", "factor", "attention_factor",
                  "original_max_position_embeddings",
                  "max_position_embeddings"},
                 {"short_factor", "long_factor",
                  "original_max_position_embeddings"}),
    "proportional": ({"factor", "partial_rotary_factor"}, set()),
}


def normalize_scaling(scaling: Any) -> tuple[tuple[str, Any], ...]:
  """`rope_scaling` as sorted (key, value) pairs; () for plain RoPE.

  Accepts a mapping (HF `rope_parameters`, a ConfigDict) or pairs; list
  values (longrope's factors) become tuples, so the pairs stay hashable.
  Raises ValueError naming what is wrong (unknown rope_type, unknown or
  missing keys).
  """
  if not scaling:
    return ()
  items = dict(scaling.items() if hasattr(scaling, "items") else scaling)
  items.pop("rope_theta", None)
  if "type" in items:  # transformers 4 spelling.
    items.setdefault("rope_type", items.pop("type"))
  rope_type = items.get("rope_type", "default")
  if rope_type == "default":
    return ()
  if rope_type not in ROPE_KEYS:
    raise ValueError(f"rope_type={rope_type!r} is not supported; supported: "
                     f"'default', {', '.join(map(repr, sorted(ROPE_KEYS)))}.")
  known, required = ROPE_KEYS[rope_type]
  items = {k: tuple(v) if isinstance(v, (list, tuple)) else v
           for k, v in items.items() if v is not None}
  extra = sorted(set(items) - known - {"rope_type"})
  missing = sorted(required - set(items))
  if extra or missing:
    raise ValueError(
        f"rope_type={rope_type!r}: unsupported keys {extra}, missing keys "
        f"{missing} (it takes {sorted(known)}).")
  return tuple(sorted(items.items()))


def inv_frequencies(head_dim: int, theta: float, scaling: Any = ()
                    ) -> tuple[np.ndarray, float]:
  """float32[head_dim // 2] inverse frequencies and the cos/sin scale.

  For `dynamic` these are the frequencies within max_position_embeddings
  (plain RoPE); `apply_rope` rescales beyond it.
  """
  s = dict(normalize_scaling(scaling))
  rope_type = s.get("rope_type", "default")
  exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(
      head_dim)
  pos_freqs = np.float32(theta) ** exponents
  inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
  if rope_type == "linear":
    return (inv_freq / np.float32(s["factor"])).astype(np.float32), 1.0
  if rope_type == "llama3":
    return _llama3(inv_freq, s), 1.0
  if rope_type == "yarn":
    return _yarn(pos_freqs, head_dim, theta, s)
  if rope_type == "longrope":
    return _longrope(pos_freqs, s, "short_factor")
  if rope_type == "proportional":
    angles = int(float(s.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    inv_freq[angles:] = 0.0
    return (inv_freq / np.float32(s.get("factor", 1.0))).astype(
        np.float32), 1.0
  return inv_freq, 1.0


def _longrope(pos_freqs: np.ndarray, s: Mapping[str, Any],
              which: str) -> tuple[np.ndarray, float]:
  """LongRoPE's inverse frequencies with `which` factors, and its cos/sin
  scale."""
  factors = np.asarray(s[which], np.float32)
  if factors.shape != pos_freqs.shape:
    raise ValueError(f"longrope {which} has {factors.size} entries; the "
                     f"rotated channels need {pos_freqs.size}.")
  original = float(s["original_max_position_embeddings"])
  factor = s.get("factor")
  if factor is None:
    factor = float(s.get("max_position_embeddings", original)) / original
  scale = s.get("attention_factor")
  if scale is None:
    scale = 1.0 if factor <= 1.0 else math.sqrt(
        1 + math.log(factor) / math.log(original))
  return (np.float32(1.0) / (factors * pos_freqs)).astype(np.float32), float(
      scale)


def longrope_frequencies(head_dim: int, theta: float, scaling: Any,
                         positions: Array) -> tuple[Array, float]:
  """longrope's inverse frequencies for a call over `positions` (short
  factors up to original_max_position_embeddings tokens, long beyond) and
  its cos/sin scale."""
  s = dict(normalize_scaling(scaling))
  pos_freqs = np.float32(theta) ** (
      np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
  short, scale = _longrope(pos_freqs, s, "short_factor")
  long, _ = _longrope(pos_freqs, s, "long_factor")
  beyond = jnp.max(positions) + 1 > s["original_max_position_embeddings"]
  return jnp.where(beyond, jnp.asarray(long), jnp.asarray(short)), scale


def _llama3(inv_freq: np.ndarray, s: Mapping[str, Any]) -> np.ndarray:
  factor = np.float32(s["factor"])
  low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
  old = float(s["original_max_position_embeddings"])
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
  smooth = ((np.float32(old) / wavelen - np.float32(low))
            / np.float32(high - low)).astype(np.float32)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(pos_freqs: np.ndarray, dim: int, theta: float,
          s: Mapping[str, Any]) -> tuple[np.ndarray, float]:
  original = float(s["original_max_position_embeddings"])
  factor = s.get("factor")
  if factor is None:
    factor = float(s["max_position_embeddings"]) / original
  factor = float(factor)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention = s.get("attention_factor")
  if attention is None:
    if s.get("mscale") and s.get("mscale_all_dim"):
      attention = mscale(factor, s["mscale"]) / mscale(factor,
                                                       s["mscale_all_dim"])
    else:
      attention = mscale(factor)
  beta_fast = s.get("beta_fast") or 32
  beta_slow = s.get("beta_slow") or 1

  def correction_dim(rotations):
    return (dim * math.log(original / (rotations * 2 * math.pi))
            / (2 * math.log(theta)))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if s.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # As transformers: no division by zero.
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  extrapolation = np.float32(1) - ramp
  inv_extra = np.float32(1) / pos_freqs
  inv_inter = np.float32(1) / (np.float32(factor) * pos_freqs)
  inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
  return inv_freq.astype(np.float32), float(attention)


def _dynamic_inv_freq(head_dim: int, theta: float, s: Mapping[str, Any],
                      positions: Array) -> Array:
  factor = jnp.float32(s["factor"])
  max_pos = s["max_position_embeddings"]
  length = jnp.maximum(jnp.max(positions) + 1, max_pos).astype(jnp.float32)
  base = theta * ((factor * length / max_pos) - (factor - 1)) ** (
      head_dim / (head_dim - 2))
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  return 1.0 / (base ** exponents)


def apply_rope(x: Array, positions: Array, theta: float,
               scaling: Any = (), rotary_dim: int = 0) -> Array:
  """Rotary embedding, HF layout: (x*cos + rotate_half(x)*sin) * scale.

  Args:
    x: [B, T, H, Dh].
    positions: int32[B, T].
    theta: base frequency.
    scaling: `ModelConfig.rope_scaling` (module docstring).
    rotary_dim: rotate only the first rotary_dim channels of each head and
      pass the rest through (GLM's partial rotary); 0 rotates all Dh.
  """
  if rotary_dim and rotary_dim < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :rotary_dim], positions, theta,
                                       scaling), x[..., rotary_dim:]], axis=-1)
  dh = x.shape[-1]
  scaling = normalize_scaling(scaling)
  s = dict(scaling)
  if s.get("rope_type") == "dynamic":
    inv_freq, scale = _dynamic_inv_freq(dh, theta, s, positions), 1.0
  elif s.get("rope_type") == "longrope":
    inv_freq, scale = longrope_frequencies(dh, theta, scaling, positions)
  else:
    inv_freq, scale = inv_frequencies(dh, theta, scaling)
    inv_freq = jnp.asarray(inv_freq)
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb) * scale, jnp.sin(emb) * scale
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)
