"""Grouped-query self-attention with RoPE and an optional KV cache."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param
from sao_jax.models.layers.kv_cache import write
from sao_jax.models.layers.norms import RMSNorm
from sao_jax.models.layers.rope import apply_rope

Array = jax.Array


_MASK_VALUE = -1e30  # Finite, so fully-masked (padding) queries give no NaNs.


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE and an optional KV cache."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x, positions, mask, kv=None):
    """x: [B,T,D]; mask: bool[B,T,S]; kv: (k_all, v_all, layer, end) or None.

    Returns (out [B,T,D], updated (k_all, v_all) or None).
    """
    cfg = self.config
    h, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    d = cfg.hidden_size
    init = nn.initializers.normal(INIT_STD)

    def proj(name, heads, head_axis):
      kernel = param(self, f"{name}_proj", init, (d, heads, dh),
                      ("embed", head_axis, "head_dim"))
      y = jnp.einsum("btd,dhk->bthk", x, kernel.astype(x.dtype))
      if cfg.qkv_bias:
        bias = param(self, f"{name}_bias", nn.initializers.zeros,
                      (heads, dh), (head_axis, "head_dim"))
        y = y + bias.astype(x.dtype)
      return y

    q, k = proj("q", h, "heads"), proj("k", hkv, "kv_heads")
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE.
      q = RMSNorm(cfg, dh, "head_dim", name="q_norm")(q).astype(x.dtype)
      k = RMSNorm(cfg, dh, "head_dim", name="k_norm")(k).astype(x.dtype)
    q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling,
                   cfg.rotary_dim)
    k = apply_rope(k, positions, cfg.rope_theta, cfg.rope_scaling,
                   cfg.rotary_dim)
    v = proj("v", hkv, "kv_heads")

    new_kv = None
    if kv is not None:
      k_all, v_all, layer, end = kv
      k_all = write(k_all, k, end, (layer,))
      v_all = write(v_all, v, end, (layer,))
      new_kv = (k_all, v_all)
      k, v = k_all[layer].astype(x.dtype), v_all[layer].astype(x.dtype)

    b, t = x.shape[:2]
    q = q.reshape(b, t, hkv, h // hkv, dh)  # Query head j*G+g uses kv head j.
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(
                            jnp.float32(dh))
    logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, dh)
    o_kernel = param(self, "o_proj", init, (h, dh, d),
                      ("heads", "head_dim", "embed"))
    return jnp.einsum("bthk,hkd->btd", out, o_kernel.astype(x.dtype)), new_kv
