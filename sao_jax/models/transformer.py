"""Decoder-only transformer (Llama / Qwen2 family) and value model.

Built from the shared layers in `sao_jax/models/layers/` (one concern a
module: norms, rotary, attention, MLP, embedding, masks, KV cache): RMSNorm, rotary embeddings (HF `rotate_half` layout, so
HF weights load without permutation), grouped-query attention, SwiGLU MLP,
optional q/k/v bias (Qwen2), tied or untied output embedding. Parameters carry
logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim')
for sharding; activations are constrained to ('batch', 'length', ...).

Parameter tree (`variables['params']`) of `Transformer`:
  decoder/embedder/embedding              [vocab, embed]
  decoder/layers_{i}/attn_norm/scale      [embed]
  decoder/layers_{i}/attn/{q,k,v}_proj    [embed, (kv_)heads, head_dim]
  decoder/layers_{i}/attn/{q,k,v}_bias    [(kv_)heads, head_dim]  (qkv_bias)
  decoder/layers_{i}/attn/{q,k}_norm/scale [head_dim]  (qk_norm, Qwen3)
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

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.attention import Attention
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param
from sao_jax.models.layers.embed import Embedder
from sao_jax.models.layers.kv_cache import KVCache
# The model's interface: the cache and positions its callers build.
from sao_jax.models.layers.kv_cache import init_cache  # pylint: disable=unused-import
from sao_jax.models.layers.masks import attention_mask as _attention_mask
from sao_jax.models.layers.masks import positions_from_mask  # pylint: disable=unused-import
from sao_jax.models.layers.mlp import MLP
from sao_jax.models.layers.norms import RMSNorm

Array = jax.Array


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
      kernel = param(self, "lm_head", nn.initializers.normal(INIT_STD),
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
    kernel = param(self, "kernel", nn.initializers.normal(INIT_STD),
                    (self.config.hidden_size, 1), ("embed", None))
    bias = param(self, "bias", nn.initializers.zeros, (1,), (None,))
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
