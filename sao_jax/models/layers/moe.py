"""Mixture-of-experts feed-forward: routers, dropless grouped experts, R3.

Two routers (`MoeConfig.router`):
  'softmax'  Qwen3-MoE: p = softmax(W_r x); the top-k experts by p, their
             weights p renormalised to sum 1 when `norm_topk_prob`.
  'sigmoid'  GLM-4.5 / DeepSeek-V3 (without MLA): s = sigmoid(W_r x); experts
             are chosen on s + b (the score-correction bias b, not trained by
             gradient) within the `topk_group` best of `n_group` groups (a
             group's score: the sum of its two best); their weights are s
             (without b), renormalised when `norm_topk_prob`, times
             `routed_scaling_factor`.
The chosen experts run dropless: the N·k (token, expert) assignments are
sorted by expert and each expert's SwiGLU runs on its own rows only, as three
`jax.lax.ragged_dot` grouped matmuls (no expert sees a token it was not
routed, no capacity, no dropped tokens). GLM's shared experts are one dense
SwiGLU on every token, added to the routed output; Qwen3-Next's
(`shared_expert_gate`) is scaled by sigmoid(x . w_g) per token first.

Routing replay (R3): with `forced` expert ids (those the sampler recorded),
the block uses them instead of its own choice and recomputes only their
weights from the router, so the router still gets gradients.

The router's load-balancing loss (Switch Transformer Eqs. 4-6, as in HF
`load_balancing_loss_func`): E · Σ_e f_e · P_e, f_e the fraction of the
(real-token) assignments routed to e, P_e the mean router probability of e
(the sigmoid router's scores normalised per token).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Routing:
  """A router's decision for N tokens: experts int32[N, k] (used), weights
  f32[N, k], per-expert probabilities f32[N, E] for the load-balancing loss,
  and own int32[N, k], its own choice (= experts unless replay forced them)."""

  experts: Array
  weights: Array
  probs: Array
  own: Array


def _group_mask(choice: Array, moe: MoeConfig) -> Array:
  """bool[N, E]: experts in the token's `topk_group` best groups."""
  n, e = choice.shape
  groups = choice.reshape(n, moe.n_group, e // moe.n_group)
  best_two = jax.lax.top_k(groups, min(2, e // moe.n_group))[0].sum(-1)
  _, picked = jax.lax.top_k(best_two, moe.topk_group)  # [N, topk_group]
  keep = jnp.zeros((n, moe.n_group), jnp.bool_).at[
      jnp.arange(n)[:, None], picked].set(True)
  return jnp.repeat(keep, e // moe.n_group, axis=1)


def route(logits: Array, moe: MoeConfig, bias: Array | None = None,
          forced: Array | None = None) -> Routing:
  """Top-k routing of float32 router logits [N, E] (module docstring).

  Args:
    logits: float32 [N, E].
    moe: the layer's experts.
    bias: float32 [E], the sigmoid router's score-correction bias.
    forced: int32 [N, k] expert ids to use instead of the router's choice
      (routing replay); their weights are recomputed from ``logits``.
  """
  logits = logits.astype(jnp.float32)
  if moe.router == "softmax":
    probs = jax.nn.softmax(logits, axis=-1)
    choice = probs
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    choice = scores + (0.0 if bias is None else
                       jax.lax.stop_gradient(bias.astype(jnp.float32)))
    if moe.n_group > 1:
      choice = jnp.where(_group_mask(choice, moe), choice, -jnp.inf)
  _, own = jax.lax.top_k(jax.lax.stop_gradient(choice), moe.top_k)
  experts = (own if forced is None else forced).astype(jnp.int32)
  gate = probs if moe.router == "softmax" else scores
  weights = jnp.take_along_axis(gate, experts, axis=-1)
  if moe.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (
        0.0 if moe.router == "softmax" else 1e-20))
  return Routing(experts, weights * moe.routed_scaling_factor, probs,
                 own.astype(jnp.int32))


def grouped_swiglu(x: Array, experts: Array, weights: Array, w_gate: Array,
                   w_up: Array, w_down: Array) -> Array:
  """Σ_j weights[n, j] · SwiGLU_{experts[n, j]}(x[n]), dropless, [N, D].

  The N·k assignments are sorted by expert; `jax.lax.ragged_dot` then runs
  each expert's rows against its own weights (w_gate, w_up [E, D, F],
  w_down [E, F, D]).
  """
  n, k = experts.shape
  num_experts = w_gate.shape[0]
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  token = order // k
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  xs = x[token]
  f32 = jnp.float32
  gate = jax.lax.ragged_dot(xs, w_gate.astype(x.dtype), sizes,
                            preferred_element_type=f32)
  up = jax.lax.ragged_dot(xs, w_up.astype(x.dtype), sizes,
                          preferred_element_type=f32)
  hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
  out = jax.lax.ragged_dot(hidden, w_down.astype(x.dtype), sizes,
                           preferred_element_type=f32)
  out = out * weights.reshape(-1)[order][:, None].astype(f32)
  return jnp.zeros((n, x.shape[-1]), f32).at[token].add(out).astype(x.dtype)


def load_balancing_loss(routing: Routing, mask: Array | None = None) -> Array:
  """E · Σ_e f_e · P_e over the real tokens (module docstring), a scalar."""
  n, e = routing.probs.shape
  w = jnp.ones((n,), jnp.float32) if mask is None else mask.reshape(
      n).astype(jnp.float32)
  total = jnp.maximum(jnp.sum(w), 1.0)
  counts = jnp.zeros((e,), jnp.float32).at[routing.experts].add(
      jnp.broadcast_to(w[:, None], routing.experts.shape))
  frac = counts / total  # Sums to k, as HF's.
  mean_prob = jnp.sum(routing.probs * w[:, None], axis=0) / total
  return e * jnp.sum(frac * mean_prob)


class MoeBlock(nn.Module):
  """Routed experts (+ shared experts): [B, T, D] -> [B, T, D].

  Parameters: router/kernel [embed, expert], router/bias [expert] (sigmoid
  router), experts/{gate,up}_proj [expert, embed, mlp], experts/down_proj
  [expert, mlp, embed], shared_{gate,up,down}_proj (n_shared_experts > 0),
  shared_expert_gate [embed] (`MoeConfig.shared_expert_gate`).
  Returns (y, experts int32 [B, T, k] used, load-balancing loss, the
  router's own choice [B, T, k]); the experts are what the sampler records
  for replay.
  """

  config: ModelConfig
  moe: MoeConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array | None = None,
               forced: Array | None = None):
    moe, d = self.moe, self.config.hidden_size
    e, f = moe.num_experts, moe.intermediate_size
    init = nn.initializers.normal(INIT_STD)
    b, t = x.shape[:2]
    router = param(self, "router_kernel", init, (d, e), ("embed", "expert"))
    bias = None
    if moe.router == "sigmoid":
      bias = param(self, "router_bias", nn.initializers.zeros, (e,),
                   ("expert",))
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32),
                        router.astype(jnp.float32))
    routing = route(logits.reshape(b * t, e), moe, bias,
                    None if forced is None else forced.reshape(b * t, -1))
    w_gate = param(self, "gate_proj", init, (e, d, f),
                   ("expert", "embed", "mlp"))
    w_up = param(self, "up_proj", init, (e, d, f), ("expert", "embed", "mlp"))
    w_down = param(self, "down_proj", init, (e, f, d),
                   ("expert", "mlp", "embed"))
    y = grouped_swiglu(x.reshape(b * t, d), routing.experts, routing.weights,
                       w_gate, w_up, w_down).reshape(b, t, d)
    if moe.n_shared_experts:
      fs = moe.shared_width
      sg = param(self, "shared_gate_proj", init, (d, fs), ("embed", "mlp"))
      su = param(self, "shared_up_proj", init, (d, fs), ("embed", "mlp"))
      sd = param(self, "shared_down_proj", init, (fs, d), ("mlp", "embed"))
      hdn = jax.nn.silu(x @ sg.astype(x.dtype)) * (x @ su.astype(x.dtype))
      shared = hdn @ sd.astype(x.dtype)
      if moe.shared_expert_gate:
        w = param(self, "shared_expert_gate", init, (d,), ("embed",))
        shared = jax.nn.sigmoid(x @ w.astype(x.dtype))[..., None] * shared
      y = y + shared
    aux = load_balancing_loss(routing, mask)
    shape = (b, t, moe.top_k)
    return (y, routing.experts.reshape(shape), aux,
            routing.own.reshape(shape))
