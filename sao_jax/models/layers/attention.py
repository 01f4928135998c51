"""Grouped-query self-attention with RoPE and an optional KV cache.

The attention core is chosen by `ModelConfig.attention` (`choose`): the dense
reference (materialised scores and mask), the blockwise online-softmax path
(layers/blockwise.py), cuDNN or splash (layers/fused.py). docs/design/models.md
"Attention".
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ATTENTION_IMPLEMENTATIONS
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param
from sao_jax.models.layers.blockwise import blockwise_attention
from sao_jax.models.layers.fused import cudnn_attention
from sao_jax.models.layers.fused import splash_attention
from sao_jax.models.layers.kv_cache import write
from sao_jax.models.layers.masks import dense_mask
from sao_jax.models.layers.masks import MaskSpec
from sao_jax.models.layers.norms import RMSNorm
from sao_jax.models.layers.rope import apply_rope

Array = jax.Array


_MASK_VALUE = -1e30  # Finite, so fully-masked (padding) queries give no NaNs.
IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_TARGET = contextvars.ContextVar("attention_target_backend", default=None)


@contextlib.contextmanager
def lowering_for(backend: str) -> Iterator[None]:
  """Choose attention for `backend` ('cpu', 'gpu', 'tpu') while tracing here:
  ahead-of-time lowering for a device this host does not have. The choice is
  made at trace time, so lower a jitted function not yet traced elsewhere."""
  token = _TARGET.set(backend)
  try:
    yield
  finally:
    _TARGET.reset(token)


def choose(cfg: ModelConfig, t: int, s: int, cached: bool,
           backend: str | None = None) -> str:
  """The attention core for T queries over S keys on `backend`.

  Decode (a cache, T == 1) is dense. The fused kernels take self-attention
  without a cache; a cached chunk (prefill, observation) with 'cudnn' or
  'splash' uses the blockwise path. 'auto': cuDNN on GPU (bf16/fp16), splash
  on TPU, blockwise elsewhere, except dense on CPU when [T, S] is no larger
  than one [block_q, block_kv] block (the same work without the loop;
  BENCHMARKS.md, "Attention paths").
  `backend` defaults to the `lowering_for` target, else JAX's default. Raises ValueError for an unknown name or a kernel the backend lacks.
  """
  name = cfg.attention
  backend = backend or _TARGET.get() or jax.default_backend()
  if name not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention={name!r}; expected one of "
                     f"{IMPLEMENTATIONS}.")
  if cached and t == 1:
    return "dense"
  half = cfg.compute_dtype in _HALF
  if name == "cudnn" and (backend != "gpu" or not half):
    raise ValueError(
        f"model.attention='cudnn' needs a GPU and bf16/fp16 compute (backend "
        f"{backend!r}, model.dtype={cfg.dtype!r}); use 'auto' or 'blockwise'.")
  if name == "splash" and backend != "tpu":
    raise ValueError(
        f"model.attention='splash' runs on TPU only (backend {backend!r}); "
        "use 'auto' or 'blockwise'.")
  # Sliding and full layers mixed (linear layers do not attend).
  per_layer = len(set(cfg.layer_types) - {"linear_attention"}) > 1
  if name in ("cudnn", "splash") and per_layer and cfg.scan_layers:
    raise ValueError(
        f"model.attention={name!r} takes one static window, but layer_types "
        "mixes sliding and full layers under scan_layers (a traced window); "
        "use 'auto' or 'blockwise', or scan_layers=False.")
  if name in ("cudnn", "splash"):
    return "blockwise" if cached else name
  if name != "auto":
    return name
  if per_layer and cfg.scan_layers:
    pass  # A traced per-layer window: the fused kernels need a static one.
  elif not cached and backend == "gpu" and half:
    return "cudnn"
  elif not cached and backend == "tpu":
    return "splash"
  one_block = t * s <= cfg.attention_block_q * cfg.attention_block_kv
  return "dense" if backend == "cpu" and one_block else "blockwise"


def dense_attention(q: Array, k: Array, v: Array, spec: MaskSpec) -> Array:
  """The reference: [B, K, G, T, S] float32 scores under the dense mask.

  q: [B, T, K, G, D]; k, v: [B, S, K, D]; returns [B, T, K, G, D].
  """
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k,
                      preferred_element_type=jnp.float32) / jnp.sqrt(
                          jnp.float32(q.shape[-1]))
  logits = jnp.where(dense_mask(spec)[:, None, None], logits, _MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v)


def attend(cfg: ModelConfig, q: Array, k: Array, v: Array, spec: MaskSpec,
           cached: bool) -> Array:
  """softmax(q k^T / sqrt(D)) v under `spec` with the core `choose` picks."""
  impl = choose(cfg, q.shape[1], k.shape[1], cached)
  bq, bkv = cfg.attention_block_q, cfg.attention_block_kv
  if impl == "dense":
    return dense_attention(q, k, v, spec)
  if impl == "blockwise":
    return blockwise_attention(q, k, v, spec, block_q=bq, block_kv=bkv)
  if impl == "cudnn":
    return cudnn_attention(q, k, v, spec, block_q=bq, block_kv=bkv)
  return splash_attention(q, k, v, spec, block=bq)


def _fit(y: Array, cache: Array) -> Array:
  """y [B, T, H, D] zero-padded to the cache's slot (heads, width)."""
  pad = [(0, 0)] * (y.ndim - 2) + [(0, cache.shape[-2] - y.shape[-2]),
                                   (0, cache.shape[-1] - y.shape[-1])]
  return jnp.pad(y, pad)


class Attention(nn.Module):
  """Grouped-query self-attention with RoPE and an optional KV cache.

The attention core is chosen by `ModelConfig.attention` (`choose`): the dense
reference (materialised scores and mask), the blockwise online-softmax path
(layers/blockwise.py), cuDNN or splash (layers/fused.py). docs/design/models.md
"Attention".
"""

  config: ModelConfig
  # (key/value heads, head width, values = k_proj's output) of this layer
  # (`ModelConfig.attention_dims`); None: layer 0's, as every layer's where
  # they are alike.
  dims: tuple[int, int, bool] | None = None
  # Later layers attend with this layer's keys and values (Gemma 4's shared
  # KV): without a cache it returns them in place of the cache.
  source: bool = False

  @nn.compact
  def __call__(self, x, positions, spec: MaskSpec, kv=None, local=None,
               use_rope=None, shared_kv=None):
    """x: [B,T,D]; spec: which keys each query sees (layers/masks.py);
    kv: (k_all, v_all, layer, end) or None; local: whether this is a
    sliding-window layer (a bool, or a traced bool scalar under a layer scan
    mixing both kinds; None: every layer is like layer 0); use_rope: whether
    q and k are rotated (False: a NoPE layer, `ModelConfig.nope_layers`;
    a bool or a traced bool scalar; None: as layer 0). shared_kv: (k, v,
    the cache's end or None) of the layer whose keys and values this one
    attends with (Gemma 4's KV-shared layers: no k/v projections, nothing
    written).

    Returns (out [B,T,D], updated (k_all, v_all) or None). A cache wider
    than this layer's keys (layers of several shapes, Gemma 4) holds them
    in its first heads and channels.
    """
    cfg = self.config
    hkv, dh, k_eq_v = self.dims or cfg.attention_dims(0)
    h = cfg.num_heads
    d = cfg.hidden_size
    init = nn.initializers.normal(INIT_STD)

    def proj(name, heads, head_axis, width=dh):
      kernel = param(self, f"{name}_proj", init, (d, heads, width),
                      ("embed", head_axis, "head_dim"))
      y = jnp.einsum("btd,dhk->bthk", x, kernel.astype(x.dtype))
      if cfg.qkv_bias:
        bias = param(self, f"{name}_bias", nn.initializers.zeros,
                      (heads, dh), (head_axis, "head_dim"))
        y = y + bias.astype(x.dtype)
      return y

    gate = None
    if cfg.attn_output_gate:  # Qwen3.5: per head, dh query then dh gate.
      q = proj("q", h, "heads", 2 * dh)
      q, gate = q[..., :dh], q[..., dh:]
    else:
      q = proj("q", h, "heads")
    if shared_kv is not None:  # Another layer's k, v (Gemma 4).
      k, v, shared_end = shared_kv
    else:
      k = proj("k", hkv, "kv_heads")
      v = k if k_eq_v else proj("v", hkv, "kv_heads")  # Gemma 4: values = k.
      if cfg.norm_style == "gemma4":  # A scale-free norm on each value head.
        v = RMSNorm(cfg, dh, "head_dim", with_scale=False, name="v_norm")(
            v).astype(x.dtype)
    own_k = shared_kv is None
    if cfg.qk_norm_full_width:  # OLMo 2: over all heads' channels at once.
      q = RMSNorm(cfg, (h, dh), ("heads", "head_dim"), name="q_norm")(
          q).astype(x.dtype)
      k = RMSNorm(cfg, (hkv, dh), ("kv_heads", "head_dim"), name="k_norm")(
          k).astype(x.dtype)
    elif cfg.qk_norm:  # Qwen3: RMSNorm over each head's q and k, before RoPE.
      q = RMSNorm(cfg, dh, "head_dim", name="q_norm")(q).astype(x.dtype)
      if own_k:
        k = RMSNorm(cfg, dh, "head_dim", name="k_norm")(k).astype(x.dtype)
    local = cfg.is_local_layer(0) if local is None else local
    static = isinstance(local, bool)

    def rope(y):  # Sliding layers may have their own base (Gemma 3).
      full = apply_rope(y, positions, cfg.rope_theta, cfg.rope_scaling,
                        cfg.rotary_dim)
      if not cfg.local_rope_theta or (static and not local):
        return full
      near = apply_rope(y, positions, cfg.local_rope_theta, (),
                        cfg.rotary_dim)
      return (near if local else full) if static else jnp.where(
          local, near, full)

    use_rope = cfg.uses_rope(0) if use_rope is None else use_rope
    if not isinstance(use_rope, bool):  # Mixed RoPE / NoPE layers, scanned.
      q, k = (jnp.where(use_rope, rope(y), y) for y in (q, k))
    elif use_rope:
      q, k = rope(q), rope(k) if own_k else k
    if cfg.query_pre_attn_scalar:  # Scores q.k / sqrt(scalar) (Gemma).
      q = q * jnp.asarray((dh / cfg.query_pre_attn_scalar) ** 0.5, q.dtype)

    new_kv = (k, v) if self.source and kv is None else None
    if kv is not None:
      k_all, v_all, layer, end = kv
      k_all = write(k_all, _fit(k, k_all), end, (layer,))
      v_all = write(v_all, _fit(v, v_all), end, (layer,))
      new_kv = (k_all, v_all)
      k, v = (a[layer][:, :, :hkv, :dh].astype(x.dtype)
              for a in (k_all, v_all))

    if cfg.sliding_window:  # Keys fewer than W slots back.
      spec = spec.replace(window=(
          (cfg.sliding_window if local else 0) if static else
          jnp.where(local, cfg.sliding_window, 0).astype(jnp.int32)))
    b, t = x.shape[:2]
    q = q.reshape(b, t, hkv, h // hkv, dh)  # Query head j*G+g uses kv head j.
    cached = kv is not None or (not own_k and shared_end is not None)
    out = attend(cfg, q, k, v, spec, cached).reshape(b, t, h, dh)
    if gate is not None:
      out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    o_kernel = param(self, "o_proj", init, (h, dh, d),
                      ("heads", "head_dim", "embed"))
    return jnp.einsum("bthk,hkd->btd", out, o_kernel.astype(x.dtype)), new_kv
