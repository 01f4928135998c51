"""Multi-head latent attention (MLA; DeepSeek-V2/V3, Kimi K2).

Keys and values come from one low-rank latent per token: c = RMSNorm(x W_a)
(`kv_lora_rank` wide) plus a decoupled RoPE key k_r (`qk_rope_head_dim`
wide, shared by every head); each head's k = [c W_k^h, rope(k_r)] and
v = c W_v^h (`kv_b_proj`). Queries are x W_q, or through their own low-rank
bottleneck (`q_lora_rank`: RMSNorm(x W_qa) W_qb), each head's last
`qk_rope_head_dim` channels rotated. The KV cache holds c and rope(k_r)
(`KVCache.k` [L, B, S, 1, kv_lora_rank], `KVCache.v` [L, B, S, 1,
qk_rope_head_dim]: `kv_cache.init_cache`), not the per-head keys and
values. A one-token decode step attends in the latent space ("absorbed":
q_nope W_k^h scores against c, the weighted c times W_v^h: 2 (R + Dr) H
multiply-adds a cached token instead of expanding every slot to H heads of
keys and values); other calls expand the latents and run the shared
attention core (`attention.attend`): q and k are `head_dim` = nope + rope
wide, v `v_head_dim` (zero-padded to the wider of the two, the output sliced
back). docs/design/models.md "Family layer options".

Parameters (under the block's `attn`, so they count as attention for the
optimizer labels):
  q_proj [embed, heads, head_dim]                 (q_lora_rank 0)
  q_a_proj [embed, q_lora], q_a_norm/scale [q_lora],
  q_b_proj [q_lora, heads, head_dim]              (q_lora_rank > 0)
  kv_a_proj [embed, kv_lora]: kv_lora_rank + qk_rope_head_dim outputs
  kv_a_norm/scale [kv_lora]: kv_lora_rank
  kv_b_proj [kv_lora, heads, head_dim]: per head qk_nope + v_head_dim
  o_proj [heads, head_dim, embed]: per head v_head_dim
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.attention import attend
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param
from sao_jax.models.layers.kv_cache import write
from sao_jax.models.layers.masks import dense_mask
from sao_jax.models.layers.masks import MaskSpec
from sao_jax.models.layers.norms import RMSNorm
from sao_jax.models.layers.rope import apply_rope

Array = jax.Array
# The latents' RMSNorm epsilon: DeepSeek's q_a_layernorm / kv_a_layernorm
# keep their default whatever the config's rms_norm_eps (as transformers').
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: ModelConfig) -> float:
  """MLA's score scale: head_dim^-1/2, times YaRN's mscale(factor,
  mscale_all_dim)^2 where the RoPE is YaRN with `mscale_all_dim` (as
  transformers' DeepseekV3Attention)."""
  scale = cfg.head_dim ** -0.5
  s = dict(cfg.rope_scaling)
  all_dim = s.get("mscale_all_dim") if s.get("rope_type") == "yarn" else 0
  factor = float(s.get("factor") or 1.0)
  if all_dim and factor > 1:
    m = 0.1 * float(all_dim) * math.log(factor) + 1.0
    scale *= m * m
  return scale


def absorbed_attention(q: Array, latent: Array, k_rope: Array,
                       kv_b: Array, spec: MaskSpec, dn: int) -> Array:
  """MLA in the latent space, softmax in float32 (the decode step).

  Args:
    q: [B, T, H, Dn + Dr] scaled queries, RoPE part rotated.
    latent: [B, S, R] cached latents.
    k_rope: [B, S, Dr] cached rotated RoPE keys.
    kv_b: [R, H, Dn + Dv] `kv_b_proj`.
    spec: which slots each query sees.
    dn: the no-RoPE channels of a query/key head.

  Returns:
    [B, T, H, Dv] in q's dtype: what expanding the latents would give.
  """
  f32 = jnp.float32
  q_latent = jnp.einsum("bthn,rhn->bthr", q[..., :dn], kv_b[..., :dn],
                        preferred_element_type=f32)
  scores = (jnp.einsum("bthr,bsr->bhts", q_latent, latent.astype(f32)) +
            jnp.einsum("bthd,bsd->bhts", q[..., dn:], k_rope,
                       preferred_element_type=f32))
  scores = jnp.where(dense_mask(spec)[:, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhts,bsr->bthr", probs, latent.astype(f32))
  return jnp.einsum("bthr,rhv->bthv", out, kv_b[..., dn:].astype(f32)
                    ).astype(q.dtype)


class LatentAttention(nn.Module):
  """MLA with the same call as `attention.Attention`."""

  config: ModelConfig

  def _project_q(self, x: Array) -> Array:
    cfg = self.config
    init = nn.initializers.normal(INIT_STD)
    h, dq, d = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    if not cfg.q_lora_rank:
      kernel = param(self, "q_proj", init, (d, h, dq),
                     ("embed", "heads", "head_dim"))
      return jnp.einsum("btd,dhk->bthk", x, kernel.astype(x.dtype))
    r = cfg.q_lora_rank
    a = param(self, "q_a_proj", init, (d, r), ("embed", "q_lora"))
    b = param(self, "q_b_proj", init, (r, h, dq),
              ("q_lora", "heads", "head_dim"))
    c = RMSNorm(cfg, r, "q_lora", LATENT_NORM_EPS, name="q_a_norm")(
        x @ a.astype(x.dtype))
    return jnp.einsum("btr,rhk->bthk", c.astype(x.dtype), b.astype(x.dtype))

  @nn.compact
  def __call__(self, x, positions, spec: MaskSpec, kv=None, local=None,
               use_rope=None):
    """As `attention.Attention.__call__` (`local`, `use_rope`: unused; MLA
    layers are all alike); kv's (k_all, v_all) are the cached latents and
    rotated RoPE keys."""
    del local, use_rope
    cfg = self.config
    init = nn.initializers.normal(INIT_STD)
    h, d = cfg.num_heads, cfg.hidden_size
    r, dr, dv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    dn = cfg.head_dim - dr
    rope = lambda y: apply_rope(y, positions, cfg.rope_theta,
                                cfg.rope_scaling)

    q = self._project_q(x)
    q = jnp.concatenate([q[..., :dn], rope(q[..., dn:])], axis=-1)
    a = param(self, "kv_a_proj", init, (d, r + dr), ("embed", "kv_lora"))
    ckv = x @ a.astype(x.dtype)
    latent = RMSNorm(cfg, r, "kv_lora", LATENT_NORM_EPS, name="kv_a_norm")(
        ckv[..., :r]).astype(x.dtype)[:, :, None]  # [B, T, 1, R]
    k_rope = rope(ckv[..., None, r:])  # [B, T, 1, Dr]

    new_kv = None
    if kv is not None:  # Cache the latents, not per-head keys and values.
      k_all, v_all, layer, end = kv
      k_all = write(k_all, latent, end, (layer,))
      v_all = write(v_all, k_rope, end, (layer,))
      new_kv = (k_all, v_all)
      latent = k_all[layer].astype(x.dtype)
      k_rope = v_all[layer].astype(x.dtype)

    b_kernel = param(self, "kv_b_proj", init, (r, h, dn + dv),
                     ("kv_lora", "heads", "head_dim"))
    o_kernel = param(self, "o_proj", init, (h, dv, d),
                     ("heads", "head_dim", "embed"))
    if kv is not None and x.shape[1] == 1:  # Decode: stay in the latent.
      out = absorbed_attention(
          q * jnp.asarray(softmax_scale(cfg), q.dtype), latent[:, :, 0],
          k_rope[:, :, 0], b_kernel.astype(x.dtype), spec, dn)
      return jnp.einsum("bthk,hkd->btd", out, o_kernel.astype(x.dtype)), new_kv
    kv_heads = jnp.einsum("bsr,rhk->bshk", latent[:, :, 0],
                          b_kernel.astype(x.dtype))
    k = jnp.concatenate([kv_heads[..., :dn], jnp.broadcast_to(
        k_rope, kv_heads.shape[:3] + (dr,))], axis=-1)
    v = kv_heads[..., dn:]
    width = max(cfg.head_dim, dv)  # One width for every attention core.
    pad = lambda y: jnp.pad(y, [(0, 0)] * 3 + [(0, width - y.shape[-1])])
    # The core divides by sqrt(width): pre-scale q to MLA's own scale.
    q = q * jnp.asarray(softmax_scale(cfg) * width ** 0.5, q.dtype)
    b, t = x.shape[:2]
    out = attend(cfg, pad(q).reshape(b, t, h, 1, width), pad(k), pad(v),
                 spec, kv is not None).reshape(b, t, h, width)[..., :dv]
    return jnp.einsum("bthk,hkd->btd", out, o_kernel.astype(x.dtype)), new_kv
