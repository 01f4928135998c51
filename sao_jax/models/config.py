"""Hyper-parameters of the decoder LM; the HF families are models/families/."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from sao_jax import ranges
# Re-exported: every caller catches it from here.
from sao_jax.models.families.errors import UnsupportedConfigError  # pylint: disable=unused-import
from sao_jax.models.families import registry as family_registry
from sao_jax.models.layers import rope as rope_lib

# HF `architectures` entries we can read and write (models/families/).
SUPPORTED_ARCHITECTURES = family_registry.architectures()
# `ModelConfig.norm_style` / `mlp_activation` values.
NORM_STYLES = ("llama", "gemma", "olmo", "qwen3_5", "gemma4")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# `ModelConfig.layer_types` entries (HF names).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# `ModelConfig` fields of the Gated DeltaNet layers (HF names, Qwen3.5).
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
# Mixture-of-experts architectures and the router each uses.
MOE_ARCHITECTURES = {f.architecture: f.moe_router
                     for f in family_registry.families() if f.moe_router}
# `ModelConfig.attention` values (layers/attention.choose).
ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")


# `ModelConfig.remat_policy` values (transformer.remat_policy maps them).
REMAT_POLICIES = ("none", "full", "dots_saveable",
                  "dots_with_no_batch_dims_saveable")
# Logical axis name of the stacked layer axis (scan_layers); the sharding
# rules map it to no mesh axis.
LAYERS_AXIS = "layers"


# `MoeConfig.router` values (models/layers/moe.py).
ROUTERS = ("softmax", "sigmoid")
# `ModelConfig.dtype` / `param_dtype` values.
DTYPES = ("float32", "bfloat16", "float16")

# The allowed values of single `ModelConfig` fields (`ranges`), checked by
# `ModelConfig` and, as config.model.<field>, by config_validation.
FIELD_RULES = {
    **{k: ranges.POSITIVE for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_layers",
        "num_heads", "num_kv_heads", "head_dim", "attention_block_q",
        "attention_block_kv")},
    **{k: ranges.Rule(lambda v: v >= 0, "an int >= 0 (0: no linear layers)")
       for k in LINEAR_FIELDS},
    "rope_theta": ranges.GT0, "rms_norm_eps": ranges.GT0,
    "dtype": ranges.one_of(DTYPES), "param_dtype": ranges.one_of(DTYPES),
    "logits_chunk": ranges.Rule(
        lambda v: ranges.is_int(v) and v >= 0,
        "an int >= 0 (tokens per chunk of the log-probs; 0: full logits)"),
    "attention": ranges.one_of(ATTENTION_IMPLEMENTATIONS),
    "remat_policy": ranges.one_of(REMAT_POLICIES),
    "scan_layers": ranges.Rule(lambda v: isinstance(v, bool), "True or False"),
    "sliding_window": ranges.Rule(
        lambda v: v >= 0, "an int >= 0 (attention window in tokens; 0: none)"),
    "norm_style": ranges.one_of(NORM_STYLES),
    "mlp_activation": ranges.one_of(MLP_ACTIVATIONS),
    "local_rope_theta": ranges.Rule(lambda v: v >= 0,
                                    "float >= 0 (0: rope_theta)"),
    "query_pre_attn_scalar": ranges.Rule(lambda v: v >= 0,
                                         "float >= 0 (0: head_dim)"),
    **{k: ranges.Rule(lambda v: v >= 0, "an int >= 0 (0: as the sliding "
                      "layers)") for k in ("global_head_dim",
                                           "global_kv_heads")},
    "final_logit_softcapping": ranges.Rule(lambda v: v >= 0,
                                           "float >= 0 (0: no cap)"),
    "per_layer_input_size": ranges.Rule(
        lambda v: v >= 0, "an int >= 0 (0: no per-layer embeddings)"),
    "kv_shared_layers": ranges.Rule(lambda v: v >= 0,
                                    "an int >= 0 (0: none share)"),
}


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The experts of a MoE layer (HF names in comments)."""

  num_experts: int  # num_experts / n_routed_experts / num_local_experts
  top_k: int  # num_experts_per_tok
  intermediate_size: int  # moe_intermediate_size, per expert
  router: str = "softmax"
  norm_topk_prob: bool = True
  n_group: int = 1  # sigmoid router: expert groups
  topk_group: int = 1  # sigmoid router: groups a token may use
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0  # dense experts on every token (GLM)
  # The shared experts' width (Qwen3-Next shared_expert_intermediate_size);
  # 0: n_shared_experts * intermediate_size.
  shared_intermediate_size: int = 0
  # A sigmoid gate sigmoid(x . w) on the shared experts' output (Qwen3-Next
  # shared_expert_gate).
  shared_expert_gate: bool = False

  def __post_init__(self):
    if self.router not in ROUTERS:
      raise ValueError(f"MoE router {self.router!r} is not one of {ROUTERS}.")
    if not 0 < self.top_k <= self.num_experts:
      raise ValueError(f"MoE top_k={self.top_k} must be in [1, num_experts="
                       f"{self.num_experts}].")
    if self.num_experts % self.n_group or not 0 < self.topk_group <= (
        self.n_group):
      raise ValueError(
          f"MoE n_group={self.n_group} must divide num_experts="
          f"{self.num_experts} and topk_group={self.topk_group} be in "
          f"[1, n_group].")
    if (self.shared_intermediate_size or self.shared_expert_gate) and (
        not self.n_shared_experts):
      raise ValueError(
          "MoE shared_intermediate_size / shared_expert_gate need "
          f"n_shared_experts >= 1 (got {self.n_shared_experts}).")

  @property
  def shared_width(self) -> int:
    """The shared experts' SwiGLU width (0: none)."""
    return self.shared_intermediate_size or (
        self.n_shared_experts * self.intermediate_size)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer: RMSNorm, RoPE, GQA, SwiGLU (Llama / Qwen2).

  Attributes:
    vocab_size: Number of token ids.
    hidden_size: Residual stream width ('embed').
    intermediate_size: SwiGLU hidden width ('mlp').
    num_layers: Number of decoder blocks.
    num_heads: Query heads ('heads').
    num_kv_heads: Key/value heads ('kv_heads'); must divide num_heads (GQA).
    head_dim: Per-head width ('head_dim').
    rope_theta: RoPE base frequency.
    rope_scaling: RoPE scaling, () for none: the HF `rope_parameters` without
      rope_theta (rope_type 'linear', 'llama3', 'yarn' or 'dynamic' and its
      keys; `layers/rope.py`), a mapping or sorted (key, value) pairs
      (stored as the pairs).
    rms_norm_eps: RMSNorm epsilon.
    qkv_bias: Bias on the q/k/v projections (Qwen2: True).
    qk_norm: RMSNorm over each head's q and k before RoPE (Qwen3: True).
    qk_norm_full_width: With qk_norm, one RMSNorm over all heads' q (and one
      over all k) at once, weights [heads, head_dim] (OLMo 2/3's q_norm
      over the whole q_proj output), instead of one per head.
    tie_embeddings: Output projection = input embedding transposed.
    dtype: Compute dtype of activations (logits are always float32); e.g.
      'bfloat16' with float32 `param_dtype` (master weights and optimizer
      moments stay float32, matmuls run in bf16).
    param_dtype: Storage dtype of parameters.
    logits_chunk: Tokens per chunk of the trainer's log-probs and entropy
      (`sao_jax.models.logprobs.policy_token_stats`): the output head and
      log-softmax run on max(1, logits_chunk // B) positions of every row at
      a time, recomputed in the backward, so no [B, T, V] float32 array
      exists; 0 = full-vocab logits in one piece (the reference path). A run
      setting: the numbers are the same.
    attention: Attention core: 'auto' (per backend), 'dense' (reference),
      'blockwise' (plain JAX, no [T, S] array), 'cudnn' (GPU), 'splash'
      (TPU); layers/attention.choose, docs/design/models.md "Attention".
    attention_block_q: Query block of the blockwise and splash paths.
    attention_block_kv: Key/value block of the blockwise path.
    scan_layers: Run the layers under `nn.scan` over parameters stacked on a
      leading 'layers' axis (one compiled layer body whatever the depth);
      False keeps one `layers_{i}` subtree per layer (the unrolled reference).
    remat_policy: What each decoder block keeps for the backward pass
      (`nn.remat`, one of REMAT_POLICIES): 'none' keeps everything, 'full'
      recomputes the block, 'dots_saveable' / 'dots_with_no_batch_dims_saveable'
      keep (some) matmul outputs.
    moe: The experts of the mixture-of-experts layers (None: a dense model).
    first_dense_layers: With `moe`, layers [0, first_dense_layers) keep the
      dense SwiGLU MLP (GLM-4.5 / DeepSeek-V3 `first_k_dense_replace`); the
      rest are MoE layers.
    rotary_dim: Leading channels of each head that RoPE rotates (GLM's
      partial rotary); 0 means all of head_dim.
    sliding_window: Every layer's sliding attention window (Mistral): a
      query sees keys fewer than this many tokens back, itself included
      (transformers' convention); 0 = full causal attention. With
      `layer_types`, only the 'sliding_attention' layers use it.
    layer_types: Per-layer attention kind, HF names ('full_attention' or
      'sliding_attention'; Gemma 3's interleaved local/global layers; or
      'linear_attention', a Gated DeltaNet layer, Qwen3.5's hybrid decoder);
      () means every layer is alike. Under `scan_layers` each layer's kind
      is a scanned input (one stack); a hybrid decoder (linear layers)
      scans over repeats of its layer pattern (`layer_pattern`).
    local_rope_theta: RoPE base of the sliding layers (Gemma 3
      `rope_local_base_freq`; no rope scaling there); 0 = rope_theta.
    query_pre_attn_scalar: Attention scores are q.k / sqrt(this) (Gemma);
      0 = / sqrt(head_dim).
    kv_lora_rank: Multi-head latent attention (MLA, DeepSeek-V3;
      layers/mla.py) when > 0: the width of the per-token key/value latent
      the KV cache holds; 0 = grouped-query attention. With MLA, head_dim is
      the query/key width (qk_nope + qk_rope_head_dim) and num_kv_heads ==
      num_heads.
    q_lora_rank: MLA's query bottleneck width (0: one q_proj).
    qk_rope_head_dim: MLA's rotated channels of each query/key head (the
      last ones), with one RoPE key shared by every head.
    v_head_dim: MLA's value width per head.
    nope_layers: Layers whose attention uses no position embedding (NoPE:
      q and k are not rotated; SmolLM3's `no_rope_layers` zeros), sorted
      indices; () = RoPE in every layer. Under `scan_layers` each layer's
      RoPE flag is a scanned input (one stack).
    norm_style: 'llama' (RMSNorm * w, pre-norm blocks) or 'gemma'
      ((1 + w) RMSNorm, extra norms after attention and after the MLP,
      embeddings scaled by sqrt(hidden_size)) or 'olmo' (RMSNorm * w on the
      attention and MLP outputs only, before the residual add: OLMo 2/3's
      post-norm blocks, norms `post_attn_norm`, `post_mlp_norm`) or
      'qwen3_5' ((1 + w) RMSNorm, pre-norm blocks) or 'gemma4' (Gemma's
      four norms and sqrt(hidden_size) embeddings with RMSNorm * w, a
      scale-free RMSNorm on each value head, and each block's output
      times its `layer_scalar`).
    mlp_activation: The gated MLP's activation: 'silu' or 'gelu_tanh'.
    attn_output_gate: q_proj also gives a per-head output gate: the
      attention output is multiplied by sigmoid(gate) before o_proj
      (Qwen3.5's gated attention; q_proj [embed, heads, 2 * head_dim], per
      head the query then the gate).
    linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
      linear_value_head_dim, linear_conv_kernel_dim: the Gated DeltaNet
      layers' sizes (layers/linear_attention.py; HF names); 0 without
      'linear_attention' layers.
    global_head_dim, global_kv_heads: the 'full_attention' layers' head
      width and key/value heads where they differ from the sliding
      layers' head_dim / num_kv_heads (Gemma 4's global layers); 0: the
      same. Layers of different shapes scan by repeats of the layer
      pattern (`grouped`).
    attention_k_eq_v: The 'full_attention' layers have no v_proj: values
      are the k_proj output (before k's norm and RoPE; Gemma 4).
    final_logit_softcapping: logits = cap * tanh(logits / cap) (Gemma 4);
      0: none.
    per_layer_input_size: Gemma 4's per-layer embeddings (PLE; HF
      hidden_size_per_layer_input) when > 0: each layer adds a gated
      projection of its own input of this width, from a [vocab, L * P]
      table and a projection of the embeddings (layers/per_layer.py).
    kv_shared_layers: The last this many layers have no k/v projections
      and attend with the keys and values of the last earlier layer of their
      type (`kv_source`; Gemma 4's num_kv_shared_layers).
    double_wide_mlp: Those KV-shared layers' MLPs are 2 * intermediate_size
      wide (`mlp_size`; Gemma 4's use_double_wide_mlp).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  logits_chunk: int = 0
  attention: str = "auto"
  attention_block_q: int = 512
  attention_block_kv: int = 512
  scan_layers: bool = True
  remat_policy: str = "none"
  moe: MoeConfig | None = None
  first_dense_layers: int = 0
  rotary_dim: int = 0
  rope_scaling: Any = ()
  qk_norm: bool = False
  qk_norm_full_width: bool = False
  sliding_window: int = 0
  layer_types: Any = ()
  local_rope_theta: float = 0.0
  query_pre_attn_scalar: float = 0.0
  nope_layers: Any = ()
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  norm_style: str = "llama"
  mlp_activation: str = "silu"
  attn_output_gate: bool = False
  linear_num_key_heads: int = 0
  linear_num_value_heads: int = 0
  linear_key_head_dim: int = 0
  linear_value_head_dim: int = 0
  linear_conv_kernel_dim: int = 0
  global_head_dim: int = 0
  global_kv_heads: int = 0
  attention_k_eq_v: bool = False
  final_logit_softcapping: float = 0.0
  per_layer_input_size: int = 0
  kv_shared_layers: int = 0
  double_wide_mlp: bool = False

  @classmethod
  def from_config(cls, model: Any, **overrides: Any) -> "ModelConfig":
    """From a config's ``model`` section (``moe`` with 0 experts: a dense
    model); `overrides` replace fields."""
    fields = {f.name: model[f.name] for f in dataclasses.fields(cls)
              if f.name != "moe"}
    moe = model.moe
    fields["moe"] = MoeConfig(**moe) if int(moe.num_experts) else None
    return cls(**{**fields, **overrides})

  def __post_init__(self):
    ranges.check_fields(self, FIELD_RULES)
    object.__setattr__(self, "rope_scaling",
                       rope_lib.normalize_scaling(self.rope_scaling))
    ranges.Rule(
        lambda v: v % self.num_kv_heads == 0,
        f"a multiple of num_kv_heads={self.num_kv_heads} (grouped-query "
        "attention)").check("num_heads", self.num_heads)
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(f"first_dense_layers={self.first_dense_layers} must be "
                       f"in [0, num_layers={self.num_layers}].")
    if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
      raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in "
                       f"[0, head_dim={self.head_dim}].")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.layer_types and (
        len(self.layer_types) != self.num_layers or
        not set(self.layer_types) <= set(LAYER_TYPES)):
      raise ValueError(
          f"layer_types={self.layer_types} must be () or {self.num_layers} "
          f"entries from {LAYER_TYPES}.")
    object.__setattr__(self, "nope_layers",
                       tuple(sorted(int(i) for i in self.nope_layers)))
    if not set(self.nope_layers) <= set(range(self.num_layers)) or len(
        set(self.nope_layers)) != len(self.nope_layers):
      raise ValueError(
          f"nope_layers={self.nope_layers} must be distinct layer indices in "
          f"[0, num_layers={self.num_layers}).")
    if self.kv_lora_rank:
      self._check_mla()
    elif self.q_lora_rank or self.qk_rope_head_dim or self.v_head_dim:
      raise ValueError("q_lora_rank, qk_rope_head_dim and v_head_dim are MLA "
                       "fields; set kv_lora_rank > 0 with them.")
    if self.qk_norm_full_width and not self.qk_norm:
      raise ValueError("qk_norm_full_width=True needs qk_norm=True.")
    if self.attn_output_gate and (self.qkv_bias or self.mla):
      raise ValueError("attn_output_gate cannot be combined with qkv_bias "
                       "or MLA.")
    if self.hybrid:
      self._check_linear()
    self._check_global()
    if self.kv_shared_layers:  # Every shared layer has a source.
      if self.kv_shared_layers >= self.num_layers or self.mla:
        raise ValueError(f"kv_shared_layers={self.kv_shared_layers} must be "
                         f"< num_layers={self.num_layers} (no MLA).")
      for i in range(self.num_layers):
        self.kv_source(i)

  def _check_global(self) -> None:
    """ValueError for Gemma 4's per-kind attention shapes where they cannot
    apply."""
    if not (self.global_head_dim or self.global_kv_heads or
            self.attention_k_eq_v):
      return
    if "full_attention" not in self.layer_types or self.mla:
      raise ValueError(
          "global_head_dim, global_kv_heads and attention_k_eq_v shape the "
          "'full_attention' layers of layer_types; set layer_types (no MLA).")
    if self.num_heads % (self.global_kv_heads or self.num_kv_heads):
      raise ValueError(f"global_kv_heads={self.global_kv_heads} must divide "
                       f"num_heads={self.num_heads}.")
    if self.rotary_dim or self.qkv_bias or self.attn_output_gate:
      raise ValueError("global_head_dim / global_kv_heads / "
                       "attention_k_eq_v cannot be combined with rotary_dim, "
                       "qkv_bias or attn_output_gate.")

  def attention_dims(self, i: int) -> tuple[int, int, bool]:
    """Layer i's (key/value heads, head width, values = keys' projection):
    a 'full_attention' layer's global ones (Gemma 4), else the config's."""
    if self.layer_types and self.layer_types[i] == "full_attention":
      return (self.global_kv_heads or self.num_kv_heads,
              self.global_head_dim or self.head_dim, self.attention_k_eq_v)
    return self.num_kv_heads, self.head_dim, False

  def kv_source(self, i: int) -> int:
    """The layer whose keys and values layer i attends with: i, or for the
    last `kv_shared_layers` layers the last unshared layer of their type."""
    first = self.num_layers - self.kv_shared_layers
    kind = lambda j: self.layer_types[j] if self.layer_types else ""
    if i < first:
      return i
    for j in range(first - 1, -1, -1):
      if kind(j) == kind(i):
        return j
    raise ValueError(
        f"kv_shared_layers={self.kv_shared_layers}: layer {i} "
        f"({kind(i) or 'attention'}) has no unshared layer of its type.")

  def mlp_size(self, i: int) -> int:
    """Layer i's MLP width (twice intermediate_size for a KV-shared layer
    with `double_wide_mlp`)."""
    wide = self.double_wide_mlp and self.kv_source(i) != i
    return self.intermediate_size * (2 if wide else 1)

  def member_name(self, j: int) -> str:
    """The `layer_groups` subtree of member j of the layer pattern
    (`grouped`): its kind ('linear', 'sliding' or 'full') and j."""
    kind = ("linear" if self.is_linear_layer(j) else "sliding" if
            self.layer_types[j] == "sliding_attention" else "full")
    return f"{kind}_{j}"

  @property
  def grouped(self) -> bool:
    """Whether the scanned decoder runs repeats of the layer pattern, one
    stack per member (`layer_pattern`): linear layers, or attention layers
    of different shapes (`attention_dims`)."""
    return self.hybrid or bool(
        self.per_layer_input_size or self.kv_shared_layers) or len(
            {self.attention_dims(i) for i in range(self.num_layers)}) > 1

  def _check_linear(self) -> None:
    """ValueError for Gated DeltaNet settings the hybrid decoder cannot
    run."""
    sizes = [getattr(self, k) for k in LINEAR_FIELDS]
    if min(sizes) < 1 or (
        self.linear_num_value_heads % self.linear_num_key_heads):
      raise ValueError(
          f"'linear_attention' layers need {LINEAR_FIELDS} >= 1 (got "
          f"{sizes}), value heads a multiple of key heads.")
    others = dict(mla=self.mla, nope_layers=self.nope_layers,
                  norm_style=self.norm_style not in ("llama", "qwen3_5"))
    bad = sorted(k for k, v in others.items() if v)
    if bad:
      raise ValueError(f"'linear_attention' layers cannot be combined with "
                       f"{bad} yet (issue 41).")

  def _check_mla(self) -> None:
    """ValueError for MLA settings the latent attention cannot run."""
    if not (0 < self.qk_rope_head_dim < self.head_dim and
            self.qk_rope_head_dim % 2 == 0 and self.v_head_dim > 0 and
            self.kv_lora_rank > 0 and self.q_lora_rank >= 0):
      raise ValueError(
          f"MLA needs 0 < qk_rope_head_dim={self.qk_rope_head_dim} < "
          f"head_dim={self.head_dim} (even), v_head_dim={self.v_head_dim} > 0 "
          f"and q_lora_rank={self.q_lora_rank} >= 0.")
    others = dict(num_kv_heads=self.num_kv_heads != self.num_heads,
                  qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                  sliding_window=self.sliding_window,
                  layer_types=self.layer_types, rotary_dim=self.rotary_dim,
                  nope_layers=self.nope_layers,
                  query_pre_attn_scalar=self.query_pre_attn_scalar)
    bad = sorted(k for k, v in others.items() if v)
    if bad:
      raise ValueError(
          f"MLA (kv_lora_rank={self.kv_lora_rank}) cannot be combined with "
          f"{bad} (num_kv_heads must equal num_heads).")

  @property
  def hybrid(self) -> bool:
    """Whether some layers are Gated DeltaNet linear attention."""
    return "linear_attention" in self.layer_types

  def is_linear_layer(self, i: int) -> bool:
    """Whether layer i is a Gated DeltaNet layer."""
    return bool(self.layer_types) and (
        self.layer_types[i] == "linear_attention")

  def layer_pattern(self) -> int:
    """The shortest period p of the layers' kinds (`layer_types` and
    whether each is a MoE layer) dividing num_layers (the hybrid decoder
    scans num_layers / p repeats of p layers)."""
    if self.kv_shared_layers:  # Shared KV: no period.
      return self.num_layers
    n = self.num_layers
    kind = lambda i: (self.layer_types[i], self.is_moe_layer(i))
    return next(p for p in range(1, n + 1) if n % p == 0 and all(
        kind(i) == kind(i % p) for i in range(n)))

  def linear_attention_params(self) -> int:
    """Parameters of one Gated DeltaNet layer (its projections, short
    convolutions, gates and norm)."""
    d = self.hidden_size
    keys = self.linear_num_key_heads * self.linear_key_head_dim
    hv, dv = self.linear_num_value_heads, self.linear_value_head_dim
    channels = 2 * keys + hv * dv
    return (d * (channels + hv * dv) + channels * self.linear_conv_kernel_dim
            + 2 * d * hv + 2 * hv + dv + hv * dv * d)

  def layer_attention_params(self, i: int) -> int:
    """Parameters of layer i's token mixer (attention or linear)."""
    if self.is_linear_layer(i):
      return self.linear_attention_params()
    return self.attention_params(i)

  @property
  def mla(self) -> bool:
    """Whether attention is multi-head latent attention."""
    return self.kv_lora_rank > 0

  def attention_params(self, i: int = 0) -> int:
    """Parameters of layer i's attention (projections, biases, q/k
    norms; not the block's norms)."""
    d, h = self.hidden_size, self.num_heads
    hkv, dh, k_eq_v = self.attention_dims(i)
    if self.kv_source(i) != i:  # Shared KV: q, o and q's norm only.
      return d * dh * h * 2 + (dh if self.qk_norm else 0)
    if self.mla:
      r, dr = self.kv_lora_rank, self.qk_rope_head_dim
      q = (d * self.q_lora_rank + self.q_lora_rank +
           self.q_lora_rank * h * dh) if self.q_lora_rank else d * h * dh
      return (q + d * (r + dr) + r + r * h * (dh - dr + self.v_head_dim) +
              h * self.v_head_dim * d)
    attn = d * dh * (h * 2 + hkv * (1 if k_eq_v else 2))
    if self.qkv_bias:
      attn += dh * (h + 2 * hkv)
    if self.qk_norm:
      attn += dh * ((h + hkv) if self.qk_norm_full_width else 2)
    if self.attn_output_gate:
      attn += d * h * dh
    return attn

  def is_moe_layer(self, i: int) -> bool:
    """Whether decoder layer i has routed experts."""
    return self.moe is not None and i >= self.first_dense_layers

  def stages(self) -> list[tuple[str, int, int, bool]]:
    """The runs of alike layers the scanned decoder stacks, in order:
    (subtree name, first layer, number of layers, sparse).

    A dense model is one run, `layers`; a MoE model `dense_layers` (its
    `first_dense_layers`, if any) then `moe_layers`.
    """
    if self.moe is None:
      return [("layers", 0, self.num_layers, False)]
    k = self.first_dense_layers
    return ([("dense_layers", 0, k, False)] if k else []) + [
        ("moe_layers", k, self.num_layers - k, True)]

  def is_local_layer(self, i: int) -> bool:
    """Whether layer i attends through the sliding window."""
    if self.layer_types:
      return self.layer_types[i] == "sliding_attention"
    return bool(self.sliding_window)

  def uses_rope(self, i: int) -> bool:
    """Whether layer i rotates q and k (False: a NoPE layer)."""
    return i not in self.nope_layers

  @property
  def num_moe_layers(self) -> int:
    return sum(map(self.is_moe_layer, range(self.num_layers)))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def same_architecture(self, other: ModelConfig) -> bool:
    """Equal up to the run settings dtype, param_dtype, attention,
    logits_chunk, scan_layers and remat_policy."""
    run = dict(dtype="float32", param_dtype="float32", attention="auto",
               attention_block_q=512, attention_block_kv=512, logits_chunk=0,
               scan_layers=True, remat_policy="none")
    return (dataclasses.replace(self, **run) ==
            dataclasses.replace(other, **run))

  def num_params(self) -> int:
    """Exact number of parameters of the policy `Transformer`."""
    d, f = self.hidden_size, self.intermediate_size
    attn = self.attention_params()
    norms = {"gemma": 4 * d, "gemma4": 4 * d + 1}.get(self.norm_style, 2 * d)
    dense = attn + 3 * d * f + norms  # gemma4: + layer_scalar.
    layers = self.num_layers * dense + sum(
        self.layer_attention_params(i) - attn for i in range(self.num_layers))
    if self.moe is not None:
      moe = self.moe
      sparse = attn + 2 * d + d * moe.num_experts + 3 * d * (
          moe.intermediate_size * moe.num_experts + moe.shared_width)
      if moe.shared_expert_gate:
        sparse += d
      if moe.router == "sigmoid":
        sparse += moe.num_experts  # The score-correction bias.
      layers += self.num_moe_layers * (sparse - dense)
    layers += sum(3 * d * (self.mlp_size(i) - f)
                  for i in range(self.num_layers))
    if self.per_layer_input_size:  # layers/per_layer.py.
      p, n = self.per_layer_input_size, self.num_layers
      layers += n * (2 * d * p + d) + (self.vocab_size + d) * n * p + p
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + layers + d + head

  @classmethod
  def tiny(cls, vocab_size: int = 128, **overrides) -> ModelConfig:
    """A few-layer model for tests and CPU smoke runs."""
    kw = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
    """Reads a HF `config.json` dict of a supported causal LM.

    Dispatches on `architectures` (else `model_type`) to the family module
    that registered it (models/families/). Accepts both transformers 5
    (`rope_parameters`) and 4 (`rope_theta`, `rope_scaling`) layouts.
    Raises UnsupportedConfigError for other architectures and for features
    the family's module refuses (biases on o_proj/MLP, softcapping, ...).
    """
    fields = family_registry.of_hf_config(hf).from_hf(hf)
    if isinstance(fields.get("moe"), Mapping):
      fields["moe"] = MoeConfig(**fields["moe"])
    return cls(**fields)

  def to_hf_config(self, arch: str = "LlamaForCausalLM") -> dict[str, Any]:
    """The HF `config.json` dict for `arch` (inverse of `from_hf_config`)."""
    return family_registry.get(arch).to_hf(self)

  def hf_architecture(self) -> str:
    """The HF architecture this config exports as by default."""
    return family_registry.default_for(self).architecture
