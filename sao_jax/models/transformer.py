"""Decoder-only transformer (Llama / Qwen2 family) and value model.

Built from the shared layers in `sao_jax/models/layers/` (one concern a
module: norms, rotary, attention, MLP, embedding, masks, KV cache): RMSNorm, rotary embeddings (HF `rotate_half` layout, so
HF weights load without permutation), grouped-query attention, SwiGLU MLP,
optional q/k/v bias (Qwen2), tied or untied output embedding. Parameters carry
logical axis names ('vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim')
for sharding; activations are constrained to ('batch', 'length', ...).

Parameter tree (`variables['params']`) of `Transformer` with
`scan_layers=True` (the default; docs/design/models.md "Layer layout"): every
layer's parameters stacked on a leading axis of size L (logical name 'layers',
which the sharding rules map to no mesh axis), the layers run by `nn.scan`:
  decoder/embedder/embedding              [vocab, embed]
  decoder/layers/attn_norm/scale          [L, embed]
  decoder/layers/attn/{q,k,v}_proj        [L, embed, (kv_)heads, head_dim]
  decoder/layers/attn/{q,k,v}_bias        [L, (kv_)heads, head_dim]  (qkv_bias)
  decoder/layers/attn/{q,k}_norm/scale    [L, head_dim]  (qk_norm: Qwen3, GLM)
                                          [L, (kv_)heads, head_dim]
                                          (qk_norm_full_width: OLMo 2/3)
  decoder/layers/attn/o_proj              [L, heads, head_dim, embed]
  decoder/layers/attn/...                 MLA's own (kv_lora_rank > 0:
                                          layers/mla.py)
  decoder/layer_groups/{linear,full}_{j}/... a hybrid decoder's layers
                                          (`layer_types` with
                                          'linear_attention'): [G, ...]
                                          over the G repeats of its layer
                                          pattern, member j of each repeat;
                                          a linear member's `linear_attn`
                                          is layers/linear_attention.py's
  decoder/layers/mlp_norm/scale           [L, embed]
  decoder/layers/post_{attn,mlp}_norm/scale [L, embed]  (norm_style 'gemma'
                                          or 'olmo', which has no
                                          attn_norm / mlp_norm)
  decoder/layers/mlp/{gate,up}_proj       [L, embed, mlp]
  decoder/layers/mlp/down_proj            [L, mlp, embed]
  decoder/final_norm/scale                [embed]
  lm_head                                 [embed, vocab]  (untied only)
With `scan_layers=False` (the unrolled reference) layer i is
`decoder/layers_{i}/...` with the same leaves without the L axis.
`ValueModel` shares `decoder/...` and adds
  value_head/kernel [embed, 1], value_head/bias [1].
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import LAYERS_AXIS
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.attention import Attention
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param
from sao_jax.models.layers.embed import Embedder
from sao_jax.models.layers.kv_cache import KVCache
# The model's interface: the cache and positions its callers build.
from sao_jax.models.layers.kv_cache import init_cache  # pylint: disable=unused-import
from sao_jax.models.layers.kv_cache import kind_index
from sao_jax.models.layers.linear_attention import GatedDeltaNet
from sao_jax.models.layers.linear_attention import LinearAttentionDims
from sao_jax.models.layers.masks import mask_spec
from sao_jax.models.layers.mla import LatentAttention
from sao_jax.models.layers.masks import positions_from_mask  # pylint: disable=unused-import
from sao_jax.models.layers.mlp import MLP
from sao_jax.models.layers.moe import MoeBlock
from sao_jax.models.layers.norms import RMSNorm
from sao_jax.models.layers.per_layer import PerLayerEmbedding
from sao_jax.models.layers.per_layer import PerLayerInput

Array = jax.Array


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)); x + ffn(norm(x)).

  The ffn is the SwiGLU MLP, or with ``sparse`` the routed experts of
  `layers/moe.MoeBlock` (``forced``: experts to replay, int32 [B, T, k]).
  Returns (x, new kv or None, (experts [B, T, k], load-balancing loss) or
  None). `norm_style='gemma'` adds `post_attn_norm` on the attention output
  and `post_mlp_norm` on the ffn output (HF Gemma 3's post-attention and
  post-feedforward norms; `mlp_norm` is its pre-feedforward norm);
  `norm_style='olmo'` keeps only those two (OLMo 2/3: x + norm(attn(x))). ``local``,
  ``use_rope``: Attention's sliding-layer and RoPE flags. With ``linear``
  the token mixer is Qwen3.5's Gated DeltaNet (`linear_attn`) over the
  valid tokens (``tokens``: the bool attention mask [B, T]), ``kv`` its
  (state, conv states) or None, returned updated. `norm_style='gemma4'`:
  Gemma's four norms, then the block's output times `layer_scalar` (HF
  Gemma 4's per-layer buffer, trained here like any weight). ``dims``:
  Attention's (this layer's shapes; None: layer 0's); ``shared``: no k/v
  projections (Gemma 4's KV-shared layers: ``shared_kv``, Attention's);
  ``source``: later layers share its keys and values (Attention's);
  ``mlp_size``: the MLP's width (0: intermediate_size); ``ple``: this
  layer's per-layer input [B, T, P] (layers/per_layer.py) or None.
  """

  config: ModelConfig
  sparse: bool = False
  linear: bool = False
  dims: tuple[int, int, bool] | None = None
  shared: bool = False
  source: bool = False
  mlp_size: int = 0

  @nn.compact
  def __call__(self, x, positions, mask, kv=None, forced=None, tokens=None,
               local=None, use_rope=None, ple=None, shared_kv=None):
    style = self.config.norm_style
    pre = style != "olmo"  # OLMo 2/3: norms after the sublayers only.
    post = style in ("gemma", "olmo", "gemma4")
    attention = LatentAttention if self.config.mla else Attention
    normed = RMSNorm(self.config, name="attn_norm")(x) if pre else x
    if self.linear:
      cfg = self.config
      y, new_kv = GatedDeltaNet(cfg, LinearAttentionDims(
          cfg.linear_num_key_heads, cfg.linear_num_value_heads,
          cfg.linear_key_head_dim, cfg.linear_value_head_dim,
          cfg.linear_conv_kernel_dim), name="linear_attn")(normed, tokens, kv)
      y, new_kv = y.astype(x.dtype), None if kv is None else new_kv
    else:
      mla = self.config.mla
      y, new_kv = attention(self.config, **({} if mla else {
          "dims": self.dims, "source": self.source}), name="attn")(
              normed, positions, mask, kv, local, use_rope,
              **({} if mla else {"shared_kv": shared_kv}))
    if post:
      y = RMSNorm(self.config, name="post_attn_norm")(y)
    x = x + y
    y = RMSNorm(self.config, name="mlp_norm")(x) if pre else x
    routed = None
    if self.sparse:
      y, experts, aux, own = MoeBlock(
          self.config, self.config.moe, name="moe")(y, tokens, forced)
      routed = (experts, aux, own)
    else:
      y = MLP(self.config, self.mlp_size, name="mlp")(y)
    if post:
      y = RMSNorm(self.config, name="post_mlp_norm")(y)
    x = x + y
    if ple is not None:  # Gemma 4's per-layer input.
      x = x + PerLayerInput(self.config, name="per_layer")(x, ple)
    if style == "gemma4":
      x = x * param(self, "layer_scalar", nn.initializers.ones, (1,),
                    (None,)).astype(x.dtype)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x, new_kv, routed


def remat_policy(name: str) -> Any:
  """The `jax.checkpoint` policy of a `ModelConfig.remat_policy` != 'none'.

  'full' saves nothing but the layer's inputs (recompute the whole layer);
  'dots_saveable' keeps every matmul output; 'dots_with_no_batch_dims_saveable'
  keeps the weight projections' outputs and recomputes attention's scores.
  """
  policies = jax.checkpoint_policies
  return {"full": None, "dots_saveable": policies.dots_saveable,
          "dots_with_no_batch_dims_saveable":
              policies.dots_with_no_batch_dims_saveable}[name]


def _block(cfg: ModelConfig) -> type[nn.Module]:
  """DecoderLayer under the config's remat policy (docs/design/models.md "Layer
  layout")."""
  if cfg.remat_policy == "none":
    return DecoderLayer
  # Under scan the loop already keeps XLA from merging the recomputation
  # with the forward, so no CSE barrier is needed (JAX's advice).
  return nn.remat(DecoderLayer, policy=remat_policy(cfg.remat_policy),
                  prevent_cse=not cfg.scan_layers)


def _scan_body(layer, carry, index, forced, flags, positions, mask, end,
               tokens):
  """One scanned layer. carry: (x, the whole cache's (k, v) or None): the
  cache rides in the carry and the layer writes its own slots in place at
  ``index`` (its layer in the cache), so a decode step writes one token per
  layer instead of passing each layer's cache through the scan as input and
  output. flags: the layer's (sliding-window flag, RoPE flag), each None
  where every layer is alike (`_layer_flags`)."""
  x, kv = carry
  x, new_kv, routed = layer(x, positions, mask, None if kv is None else (
      *kv, index, end), forced, tokens, *flags)
  return (x, new_kv), routed


class LayerGroup(nn.Module):
  """One repeat of a grouped decoder's layer pattern (`layer_pattern`
  layers, `{linear,full,sliding}_{j}`: `ModelConfig.member_name`), the
  body the decoder scans (`ModelConfig.grouped`)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x, kv, forced, positions, mask, end, tokens, group=0,
               ple=None):
    cfg, block = self.config, _block(self.config)
    layers = [(j, block(cfg, **_member(cfg, j), name=cfg.member_name(j)))
              for j in range(cfg.layer_pattern())]
    return _run_hybrid(cfg, layers, x, positions, mask, kv, end, tokens,
                       forced, group, ple)


def _member(cfg: ModelConfig, i: int) -> dict[str, Any]:
  """DecoderLayer's fields for layer (or pattern member) i."""
  return dict(sparse=cfg.is_moe_layer(i), linear=cfg.is_linear_layer(i),
              dims=cfg.attention_dims(i), shared=cfg.kv_source(i) != i,
              source=any(cfg.kv_source(k) == i != k
                         for k in range(cfg.num_layers)),
              mlp_size=cfg.mlp_size(i))


def _group_body(group, carry, index, forced, ple, positions, mask, end,
                tokens):
  """One scanned repeat; carry: (x, the whole cache or None), written in
  place at repeat ``index``'s layers (as `_scan_body`); forced: its MoE
  layers' experts to replay [S, B, T, k] or None. Also returns those
  layers' (experts, aux, own), each stacked [S, ...]."""
  x, kv = carry
  x, kv, routed = group(x, kv, forced, positions, mask, end, tokens, index,
                        ple)
  return (x, kv), tuple(jnp.stack(r) for r in zip(*routed))


def _run_hybrid(cfg, layers, x, positions, mask, kv, end, tokens,
                forced=None, group=0, ple=None):
  """x through hybrid layers [(layer index in the pattern or the model,
  module)]; kv: the whole cache's (k, v, linear states) or None, the
  layers' entries at ``group`` repeats of the pattern in (a traced index
  under the scan) plus their `kind_index`; forced: experts to replay
  [S, B, T, k] of their S MoE layers, or None; ple: their per-layer inputs
  [B, T, n, P] in list order, or None. A KV-shared layer (Gemma 4) attends
  with its `kv_source`'s keys and values, which ran before it (with
  KV-shared layers the pattern is the whole model). Returns (x, kv
  updated, [(experts, aux, own)] of the MoE layers in order)."""
  routed, sources = [], {}

  p = cfg.layer_pattern()
  per_repeat = sum(map(cfg.is_linear_layer, range(p)))
  base = {True: group * per_repeat, False: group * (p - per_repeat)}
  for n, (i, layer) in enumerate(layers):
    linear = cfg.is_linear_layer(i)
    j = base[linear] + kind_index(cfg, i)
    f = None if forced is None or not cfg.is_moe_layer(i) else forced[
        len(routed)]
    if linear:
      lin = None if kv is None else kv[2]
      x, new, r = layer(x, positions, mask, None if kv is None else (
          lin[0][j], tuple(c[j] for c in lin[1:])), f, tokens)
      if kv is not None:
        kv = (kv[0], kv[1], tuple(a.at[j].set(b.astype(a.dtype)) for a, b in
                                  zip(lin, (new[0], *new[1]))))
    else:
      src = cfg.kv_source(i)
      own = src == i
      x, new, r = layer(
          x, positions, mask,
          (kv[0], kv[1], j, end) if own and kv is not None else None, f,
          tokens, cfg.is_local_layer(i), True,
          None if ple is None else ple[:, :, n], sources.get(src))
      if own and kv is not None:
        kv = (*new, kv[2])
        hkv, dh, _ = cfg.attention_dims(i)
        new = tuple(a[j][:, :, :hkv, :dh].astype(x.dtype) for a in new)
      if own and new is not None:
        sources[i] = (*new, end)
    routed += [] if r is None else [r]
  return x, kv, routed


def _layer_flags(cfg: ModelConfig, first: int, n: int
                 ) -> tuple[jax.Array | None, jax.Array | None]:
  """Layers [first, first + n)'s scanned (sliding-window, RoPE) flags: bool
  [n] where the model mixes kinds (`layer_types`, `nope_layers`), else None
  (the layer reads its kind from the config)."""
  layers = range(first, first + n)
  local = jnp.asarray([cfg.is_local_layer(i) for i in layers]) if len(
      set(cfg.layer_types)) > 1 else None
  rope = jnp.asarray([cfg.uses_rope(i) for i in layers]) if (
      cfg.nope_layers) else None
  return local, rope


class Decoder(nn.Module):
  """Embedding + decoder layers + final norm (the shared backbone).

  `scan_layers`: one layer body under `nn.scan` over stacked parameters
  (the KV cache in its carry, written in place), so a step compiles one
  layer whatever the depth; else a Python loop (the unrolled reference).
  """

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedder = Embedder(cfg)
    block = _block(cfg)
    if cfg.per_layer_input_size:
      self.per_layer = PerLayerEmbedding(cfg)
    if cfg.scan_layers and cfg.grouped:
      self.group = LayerGroup(cfg, name="layer_groups")
      self._group_scan = nn.scan(
          _group_body, variable_axes={"params": 0},
          split_rngs={"params": True},
          in_axes=(0, 0, 0) + (nn.broadcast,) * 4,
          length=cfg.num_layers // cfg.layer_pattern(),
          metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
    elif cfg.scan_layers:
      self.stacks = [block(cfg, sparse, name=name)
                     for name, _, _, sparse in cfg.stages()]
      self._scans = [nn.scan(
          _scan_body, variable_axes={"params": 0},
          split_rngs={"params": True},
          in_axes=(0, 0, 0, nn.broadcast, nn.broadcast, nn.broadcast,
                   nn.broadcast),
          length=n, metadata_params={nn.PARTITION_NAME: LAYERS_AXIS})
                     for _, _, n, _ in cfg.stages()]
    else:
      self.layers = [block(cfg, **_member(cfg, i), name=f"layers_{i}")
                     for i in range(cfg.num_layers)]
    self.final_norm = RMSNorm(cfg)

  def _run_layers(self, x, positions, mask, cache, forced, tokens, ple):
    """x through every layer; returns (x, (k, v[, linear states]) of the
    cache or None, [(experts [B, T, k], aux)] of the MoE layers in order).

    Scanned, the whole cache rides in the scan's carry and each layer writes
    its new slots in place (`kv_cache.write` at its traced layer index): a
    step's cache traffic is the live keys/values it reads plus the tokens it
    writes, as unrolled."""
    cfg = self.config
    end = None if cache is None else cache.end
    routed = []
    kv = None if cache is None else (cache.k, cache.v, cache.linear)
    if cfg.grouped and not cfg.scan_layers:
      return _run_hybrid(cfg, list(enumerate(self.layers)), x, positions,
                         mask, kv, end, tokens, forced, ple=ple)
    if cfg.grouped and cfg.scan_layers:  # Repeat g writes its layers in place.
      n = cfg.num_layers // cfg.layer_pattern()
      (x, kv), routed = self._group_scan(
          self.group, (x, kv), jnp.arange(n, dtype=jnp.int32),
          None if forced is None else forced.reshape(n, -1, *forced.shape[1:]),
          None if ple is None else jnp.moveaxis(ple.reshape(
              *ple.shape[:2], n, -1, ple.shape[-1]), 2, 0),
          positions, mask, end, tokens)
      # [G, S, ...] -> the MoE layers in order (repeat g, then member).
      return x, kv, list(zip(*[a.reshape(-1, *a.shape[2:]) for a in routed]))
    if not cfg.scan_layers:
      kv = None if cache is None else (cache.k, cache.v)
      for i, layer in enumerate(self.layers):
        m = len(routed)
        x, kv, r = layer(
            x, positions, mask, None if cache is None else (*kv, i, end),
            None if forced is None or not cfg.is_moe_layer(i) else forced[m],
            tokens, cfg.is_local_layer(i), cfg.uses_rope(i))
        routed += [] if r is None else [r]
      return x, kv, routed
    kv = None if cache is None else (cache.k, cache.v)
    m = 0
    for stack, scan, (_, first, n, sparse) in zip(self.stacks, self._scans,
                                                  cfg.stages()):
      f = None if forced is None or not sparse else forced[m:m + n]
      index = jnp.arange(first, first + n, dtype=jnp.int32)
      (x, kv), r = scan(stack, (x, kv), index, f,
                        _layer_flags(cfg, first, n), positions, mask, end,
                        tokens)
      if sparse:
        routed += [tuple(a[j] for a in r) for j in range(n)]
        m += n
    return x, kv, routed

  def __call__(self, tokens, positions, attention_mask, cache=None,
               segment_ids=None, routing=None):
    """Returns (hidden [B,T,D], new cache or None).

    segment_ids: optional int32[B,T] (no cache): 0 on padding, 1, 2, ... for
    the trajectories packed into a row, each causal on its own
    (layers/masks.py); None = one trajectory per row.

    A MoE model also sows, in the 'moe' collection (apply with
    ``mutable=['moe']`` to read them; `moe_outputs`), `experts` int32
    [B, T, M, k] (what each token was routed to in each of its M MoE layers)
    and `aux_loss` (the load-balancing loss, mean over those layers).
    ``routing`` int32 [B, T, M, k]: experts to use instead of the router's
    choice (replay, R3).
    """
    if self.config.hybrid and segment_ids is not None:
      raise NotImplementedError(
          "A hybrid decoder's linear-attention layers cannot separate packed "
          "rows yet (issue 41): call it without segment_ids.")
    mask, valid = mask_spec(attention_mask, cache, segment_ids)
    x = self.embedder(tokens)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    forced = None if routing is None else jnp.moveaxis(
        routing.astype(jnp.int32), 2, 0)
    ple = self.per_layer(tokens, x) if (
        self.config.per_layer_input_size) else None
    x, kv, routed = self._run_layers(x, positions, mask, cache, forced,
                                     attention_mask.astype(jnp.bool_), ple)
    if routed:
      self.sow("moe", "experts", jnp.stack([r[0] for r in routed], axis=2))
      self.sow("moe", "aux_loss", jnp.mean(jnp.stack([r[1] for r in routed])))
      self.sow("moe", "own_experts", jnp.stack([r[2] for r in routed], axis=2))
    new_cache = None
    if cache is not None:
      new_cache = KVCache(k=kv[0], v=kv[1], valid=valid,
                          end=cache.end + tokens.shape[1],
                          linear=kv[2] if len(kv) > 2 else None)
    return self.final_norm(x), new_cache

  def attend(self, x: Array) -> Array:
    return self.embedder.attend(x)


def moe_outputs(state: Any) -> dict[str, Array]:
  """What a MoE model sowed in the 'moe' collection of an apply with
  ``mutable=['moe']`` (its state dict, or the collection itself):
  {'experts': int32 [B, T, M, k] used, 'own_experts': the router's own
  choice (differs under replay), 'aux_loss': load-balancing loss}; {} for a
  dense model."""
  sown = state.get("moe", state).get("decoder", {})
  return {k: v[0] for k, v in sown.items()}


class Transformer(nn.Module):
  """Policy LM: tokens -> float32 next-token logits.

  `__call__(tokens int32[B,T], positions int32[B,T], attention_mask bool[B,T],
  cache=None, segment_ids=None) -> (logits float32[B,T,V], new_cache or None)`.

  Without a cache, `segment_ids` int32[B,T] (0 on padding, 1, 2, ... per
  packed trajectory; positions restart at 0 per trajectory) makes each
  trajectory of a row attend only to itself; None = one per row.

  With a cache, the T tokens are written to slots [cache.end, cache.end+T)
  (of each row, with a per-row end), their validity taken from
  `attention_mask`; each query attends to valid slots up to its own. This
  covers prefill (end=0), one-token decode and appending a multi-token chunk
  (multi-turn observations). The caller must keep
  end + T <= max_len (out-of-range writes are clamped by XLA with a shared
  end, dropped with a per-row one; neither is detected).

  With `outputs='hidden'` it returns the final-norm hidden states [B,T,D]
  instead of the logits, for a head applied in chunks of tokens
  (`sao_jax.models.logprobs.chunked_token_stats`, docs/design/math.md "Chunked
  log-probs"); the output weight is then read from the params (`output_weight`).
  """

  config: ModelConfig
  outputs: str = "logits"  # 'logits' or 'hidden'.

  @nn.compact
  def __call__(self, tokens, positions, attention_mask,
               cache: KVCache | None = None, segment_ids=None, routing=None):
    cfg = self.config
    decoder = Decoder(cfg, name="decoder")
    x, new_cache = decoder(tokens, positions, attention_mask, cache,
                           segment_ids, routing)
    if self.outputs == "hidden":
      return x, new_cache
    if cfg.tie_embeddings:
      logits = decoder.attend(x)
    else:
      kernel = param(self, "lm_head", nn.initializers.normal(INIT_STD),
                      (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
      logits = jnp.einsum("btd,dv->btv", x, kernel.astype(x.dtype),
                          preferred_element_type=jnp.float32)
    logits = nn.with_logical_constraint(
        cap_logits(logits.astype(jnp.float32), cfg.final_logit_softcapping),
        ("batch", "length", "vocab"))
    return logits, new_cache


def cap_logits(logits: Array, cap: float) -> Array:
  """cap * tanh(logits / cap) (`final_logit_softcapping`, Gemma 4); the
  logits as they are for cap 0."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def output_weight(params: Any, config: ModelConfig) -> tuple[Array, str]:
  """The policy's output projection and its einsum layout ('vd' or 'dv').

  Tied: `decoder/embedder/embedding` [V, D]; untied: `lm_head` [D, V], as
  `Transformer.__call__` applies them (`params` is its plain params tree).
  """
  if config.tie_embeddings:
    return params["decoder"]["embedder"]["embedding"], "vd"
  return params["lm_head"], "dv"


class ValueHead(nn.Module):
  """Scalar head ~N(0, init_std) (0.02), zero bias (docs/design/math.md
  "Critic"); ``init_std=0``: a zero kernel, V starts constant (0)."""

  config: ModelConfig
  init_std: float = INIT_STD

  @nn.compact
  def __call__(self, x: Array) -> Array:
    init = (nn.initializers.normal(self.init_std) if self.init_std > 0
            else nn.initializers.zeros)
    kernel = param(self, "kernel", init,
                    (self.config.hidden_size, 1), ("embed", None))
    bias = param(self, "bias", nn.initializers.zeros, (1,), (None,))
    y = jnp.einsum("btd,do->bto", x.astype(jnp.float32),
                   kernel.astype(jnp.float32)) + bias.astype(jnp.float32)
    return y[..., 0]


class ValueModel(nn.Module):
  """Critic: the policy's backbone + scalar head -> token-level values [B,T]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, attention_mask,
               segment_ids=None) -> Array:
    """Values float32[B,T]; `segment_ids` as in `Transformer`."""
    x, _ = Decoder(self.config, name="decoder")(
        tokens, positions, attention_mask, segment_ids=segment_ids)
    return ValueHead(self.config, name="value_head")(x)


def value_params_from_policy(policy_params: Any, config: ModelConfig,
                             rng: Array, head_std: float = INIT_STD) -> Any:
  """Critic params: a copy of the policy backbone + fresh head ~N(0, head_std).

  Args:
    policy_params: `Transformer` params (the `variables['params']` dict, or the
      whole `{'params': ...}` variables dict; the same form is returned).
      Boxed (logically partitioned) or plain leaves are both accepted.
    config: the model config.
    rng: PRNG key for the head.
    head_std: the head kernel's init std (`rl.value_head_init_std`; 0: zeros).
  """
  wrapped = "params" in policy_params and "decoder" not in policy_params
  params = policy_params["params"] if wrapped else policy_params
  head = ValueHead(config, init_std=head_std).init(
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
