"""Decoder-only transformer (Llama / Qwen2 family), KV cache and value model.

One Flax Linen family: RMSNorm, rotary embeddings (HF `rotate_half` layout, so
HF weights load without permutation), grouped-query attention, SwiGLU MLP,
optional q/k/v bias (Qwen2), tied or untied output embedding. Parameters carry
logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim')
for sharding; activations are constrained to ('batch', 'length', ...).

Parameter tree (`variables['params']`) of `Transformer`:
  decoder/embedder/embedding              [vocab, embed]
  decoder/layers_{i}/attn_norm/scale      [embed]
  decoder/layers_{i}/attn/{q,k,v}_proj    [embed, (kv_)heads, head_dim]
  decoder/layers_{i}/attn/{q,k,v}_bias    [(kv_)heads, head_dim]  (qkv_bias)
  decoder/layers_{i}/attn/o_proj          [heads, head_dim, embed]
  decoder/layers_{i}/mlp_norm/scale       [embed]
  decoder/layers_{i}/mlp/{gate,up}_proj   [embed, mlp]
  decoder/layers_{i}/mlp/down_proj        [mlp, embed]
  decoder/final_norm/scale                [embed]
  lm_head                                 [embed, vocab]  (untied only)
`ValueModel` shares `decoder/...` and adds
  value_head/kernel [embed, 1], value_head/bias [1].
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

Array = jax.Array
_INIT_STD = 0.02  # HF `initializer_range`.
_MASK_VALUE = -1e30  # Finite, so fully-masked (padding) queries give no NaNs.


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer for generation.

  Attributes:
    k: [L, B, S, Hkv, Dh] rotated keys per slot.
    v: [L, B, S, Hkv, Dh] values per slot.
    valid: bool[B, S] slot holds a real (non-padding) token.
    end: int32, where the next tokens are written: a scalar shared by every
      row, or int32[B], one per row (the sampler's slots: each row is written
      and refilled on its own; `init_cache(per_row=True)`).
  """

  k: Array
  v: Array
  valid: Array
  end: Array

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


def init_cache(config: ModelConfig, batch_size: int, max_len: int,
               per_row: bool = False) -> KVCache:
  """An empty cache with `max_len` slots per row (one write end per row if
  ``per_row``)."""
  shape = (config.num_layers, batch_size, max_len, config.num_kv_heads,
           config.head_dim)
  return KVCache(
      k=jnp.zeros(shape, config.compute_dtype),
      v=jnp.zeros(shape, config.compute_dtype),
      valid=jnp.zeros((batch_size, max_len), jnp.bool_),
      end=jnp.zeros((batch_size,) if per_row else (), jnp.int32),
  )


def _write(buf: Array, new: Array, end: Array, lead: tuple = ()) -> Array:
  """Writes new [B, T, ...] into buf[*lead, B, S, ...] at slots end + [0, T).

  A scalar ``end`` is one slice for every row; a per-row ``end`` [B] is a
  scatter, whose writes past the last slot are dropped (padding after a
  row's real tokens may overhang; the caller keeps real tokens in range).
  """
  new = new.astype(buf.dtype)
  if end.ndim == 0:
    start = (*lead, 0, end) + (0,) * (new.ndim - 2)
    return jax.lax.dynamic_update_slice(buf, new.reshape(
        (1,) * len(lead) + new.shape), start)
  b, t = new.shape[:2]
  rows = jnp.arange(b)[:, None]
  slots = end[:, None] + jnp.arange(t)[None, :]
  return buf.at[(*lead, rows, slots)].set(new, mode="drop")


def positions_from_mask(mask: Array) -> Array:
  """RoPE positions for (left-)padded rows: cumsum(mask) - 1, clipped at 0."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _param(module: nn.Module, name: str, init, shape, names) -> Array:
  cfg = module.config
  return module.param(
      name, nn.with_logical_partitioning(init, names), shape, cfg.params_dtype)


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, in float32 (HF LlamaRMSNorm)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = _param(self, "scale", nn.initializers.ones,
                   (self.config.hidden_size,), ("embed",))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(
        jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps)
    return (scale.astype(jnp.float32) * x32).astype(self.config.compute_dtype)


def apply_rope(x: Array, positions: Array, theta: float) -> Array:
  """Rotary embedding, HF layout: x*cos + rotate_half(x)*sin.

  Args:
    x: [B, T, H, Dh].
    positions: int32[B, T].
    theta: base frequency.
  """
  dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)


class Embedder(nn.Module):
  """Token embedding; `attend` is the tied output projection."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedding = _param(
        self, "embedding", nn.initializers.normal(_INIT_STD),
        (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))

  def __call__(self, tokens: Array) -> Array:
    return jnp.take(self.embedding, tokens, axis=0).astype(
        self.config.compute_dtype)

  def attend(self, x: Array) -> Array:
    return jnp.einsum("btd,vd->btv", x, self.embedding.astype(x.dtype),
                      preferred_element_type=jnp.float32)


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
    init = nn.initializers.normal(_INIT_STD)

    def proj(name, heads, head_axis):
      kernel = _param(self, f"{name}_proj", init, (d, heads, dh),
                      ("embed", head_axis, "head_dim"))
      y = jnp.einsum("btd,dhk->bthk", x, kernel.astype(x.dtype))
      if cfg.qkv_bias:
        bias = _param(self, f"{name}_bias", nn.initializers.zeros,
                      (heads, dh), (head_axis, "head_dim"))
        y = y + bias.astype(x.dtype)
      return y

    q = apply_rope(proj("q", h, "heads"), positions, cfg.rope_theta)
    k = apply_rope(proj("k", hkv, "kv_heads"), positions, cfg.rope_theta)
    v = proj("v", hkv, "kv_heads")

    new_kv = None
    if kv is not None:
      k_all, v_all, layer, end = kv
      k_all = _write(k_all, k, end, (layer,))
      v_all = _write(v_all, v, end, (layer,))
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
    o_kernel = _param(self, "o_proj", init, (h, dh, d),
                      ("heads", "head_dim", "embed"))
    return jnp.einsum("bthk,hkd->btd", out, o_kernel.astype(x.dtype)), new_kv


class MLP(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    init = nn.initializers.normal(_INIT_STD)
    shape_in, shape_out = (cfg.hidden_size, cfg.intermediate_size), (
        cfg.intermediate_size, cfg.hidden_size)
    gate = _param(self, "gate_proj", init, shape_in, ("embed", "mlp"))
    up = _param(self, "up_proj", init, shape_in, ("embed", "mlp"))
    down = _param(self, "down_proj", init, shape_out, ("mlp", "embed"))
    hdn = jax.nn.silu(x @ gate.astype(x.dtype)) * (x @ up.astype(x.dtype))
    hdn = nn.with_logical_constraint(hdn, ("batch", "length", "mlp"))
    return hdn @ down.astype(x.dtype)


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x, positions, mask, kv=None):
    y, new_kv = Attention(self.config, name="attn")(
        RMSNorm(self.config, name="attn_norm")(x), positions, mask, kv)
    x = x + y
    y = RMSNorm(self.config, name="mlp_norm")(x)
    x = x + MLP(self.config, name="mlp")(y)
    return nn.with_logical_constraint(x, ("batch", "length", "embed")), new_kv


def _attention_mask(attention_mask: Array, cache: KVCache | None):
  """bool[B,T,S]: query t sees slot s iff s is valid and s <= slot(t).

  Also returns the updated slot validity bool[B,S].
  """
  t = attention_mask.shape[1]
  if cache is None:
    valid, q_slot = attention_mask, jnp.arange(t)
  else:
    valid = _write(cache.valid, attention_mask, cache.end)
    q_slot = cache.end[..., None] + jnp.arange(t)  # [T] or [B, T].
  q_slot = jnp.broadcast_to(q_slot, attention_mask.shape)[..., None]
  slots = jnp.arange(valid.shape[1])
  causal = slots <= q_slot  # [B, T, S]
  # A query always sees its own slot: for real tokens that changes nothing;
  # padding queries then attend only to themselves (finite, causal, and equal
  # with or without a cache) instead of to an arbitrary set of slots.
  own = slots == q_slot
  return (valid[:, None, :] & causal) | own, valid


class Decoder(nn.Module):
  """Embedding + decoder layers + final norm (the shared backbone)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedder = Embedder(cfg)
    block = nn.remat(DecoderLayer) if cfg.remat else DecoderLayer
    self.layers = [block(cfg) for _ in range(cfg.num_layers)]
    self.final_norm = RMSNorm(cfg)

  def __call__(self, tokens, positions, attention_mask, cache=None):
    """Returns (hidden [B,T,D], new cache or None)."""
    attention_mask = attention_mask.astype(jnp.bool_)
    mask, valid = _attention_mask(attention_mask, cache)
    x = self.embedder(tokens)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    kv = None if cache is None else (cache.k, cache.v)
    for i, layer in enumerate(self.layers):
      x, kv = layer(x, positions, mask,
                    None if cache is None else (*kv, i, cache.end))
    new_cache = None
    if cache is not None:
      new_cache = KVCache(k=kv[0], v=kv[1], valid=valid,
                          end=cache.end + tokens.shape[1])
    return self.final_norm(x), new_cache

  def attend(self, x: Array) -> Array:
    return self.embedder.attend(x)


class Transformer(nn.Module):
  """Policy LM: tokens -> float32 next-token logits.

  `__call__(tokens int32[B,T], positions int32[B,T], attention_mask bool[B,T],
  cache=None) -> (logits float32[B,T,V], new_cache or None)`.

  With a cache, the T tokens are written to slots [cache.end, cache.end+T)
  (of each row, with a per-row end), their validity taken from
  `attention_mask`; each query attends to valid slots up to its own. This
  covers prefill (end=0), one-token decode and appending a multi-token chunk
  (multi-turn observations). The caller must keep
  end + T <= max_len (out-of-range writes are clamped by XLA with a shared
  end, dropped with a per-row one; neither is detected).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, attention_mask,
               cache: KVCache | None = None):
    cfg = self.config
    decoder = Decoder(cfg, name="decoder")
    x, new_cache = decoder(tokens, positions, attention_mask, cache)
    if cfg.tie_embeddings:
      logits = decoder.attend(x)
    else:
      kernel = _param(self, "lm_head", nn.initializers.normal(_INIT_STD),
                      (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
      logits = jnp.einsum("btd,dv->btv", x, kernel.astype(x.dtype),
                          preferred_element_type=jnp.float32)
    logits = nn.with_logical_constraint(
        logits.astype(jnp.float32), ("batch", "length", "vocab"))
    return logits, new_cache


class ValueHead(nn.Module):
  """Scalar head ~N(0, 0.02), zero bias (docs/DESIGN.md §2, critic)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = _param(self, "kernel", nn.initializers.normal(_INIT_STD),
                    (self.config.hidden_size, 1), ("embed", None))
    bias = _param(self, "bias", nn.initializers.zeros, (1,), (None,))
    y = jnp.einsum("btd,do->bto", x.astype(jnp.float32),
                   kernel.astype(jnp.float32)) + bias.astype(jnp.float32)
    return y[..., 0]


class ValueModel(nn.Module):
  """Critic: the policy's backbone + scalar head -> token-level values [B,T]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, attention_mask) -> Array:
    x, _ = Decoder(self.config, name="decoder")(
        tokens, positions, attention_mask)
    return ValueHead(self.config, name="value_head")(x)


def value_params_from_policy(policy_params: Any, config: ModelConfig,
                             rng: Array) -> Any:
  """Critic params: a copy of the policy backbone + fresh head ~N(0, 0.02).

  Args:
    policy_params: `Transformer` params (the `variables['params']` dict, or the
      whole `{'params': ...}` variables dict; the same form is returned).
      Boxed (logically partitioned) or plain leaves are both accepted.
    config: the model config.
    rng: PRNG key for the head.
  """
  wrapped = "params" in policy_params and "decoder" not in policy_params
  params = policy_params["params"] if wrapped else policy_params
  head = ValueHead(config).init(
      rng, jnp.zeros((1, 1, config.hidden_size), config.compute_dtype)
  )["params"]
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  boxed = any(map(is_box, jax.tree.leaves(params["decoder"], is_leaf=is_box)))
  if not boxed:
    head = nn.unbox(head)
  # A real copy: the trainer may donate the policy buffers.
  decoder = jax.tree.map(lambda a: jnp.array(a, copy=True), params["decoder"])
  out = {"decoder": decoder, "value_head": head}
  return {"params": out} if wrapped else out
