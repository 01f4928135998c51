"""The SAO objective: the loss and estimators the default trajectory meets.

Everything of the SAO loss (arXiv 2607.07508, docs/design/math.md) over
``[B, T]`` token arrays: the direct double-sided importance-sampling policy loss
(``dis_policy_loss``, Eqs. 1-3), the critic's regression loss (``value_loss``)
and the critic advantage estimators they pair with: skip-observation GAE
(``gae``, Eqs. 4-5) and decoupled GAE with a length-adaptive λ_policy
(``decoupled_gae``, ``length_adaptive_lambda``; SAO α=1.5, VAPO α=0.05). The
other estimators are ``sao_jax.rl.advantages``; the losses of the methods SAO is
compared with are ``sao_jax.rl.baselines``, built on the helpers here
(``prepare``, ``clamped_log_ratio``, ``ratio_metrics``, ``aggregate``).
``sao_jax.rl.registry`` names each algorithm.

Every loss is a pure function of arrays returning ``(loss, metrics)``. Inputs:
``logp`` (log π_θ, the gradient flows here), ``rollout_logp`` (recorded by the
sampler: the behaviour policy), ``advantages`` (constants) and ``mask`` (1 on
action tokens; 0 on prompt, padding and environment observations).

Conventions:

* Inputs are cast to float32 and masked-out entries zeroed *before* any
  arithmetic (``prepare``): masked tokens (even NaN/inf) never change a loss
  or a gradient, and get exactly zero gradient.
* Log-ratios are clamped to ±``MAX_LOG_RATIO`` (20: r ∈ [2e-9, 4.9e8]) before
  ``exp`` (``clamped_log_ratio``), so values and gradients stay finite however
  stale a token; beyond the clamp a token's ratio is constant (zero gradient
  through r).
* The aggregation over tokens is explicit (``aggregate``); empty rows and an
  all-zero mask give loss 0 and finite gradients.
* Metrics are scalars (masked means over action tokens unless stated).
* Estimators return 0 on non-action tokens.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp

from sao_jax.rl import metrics as rl_metrics
from sao_jax.rl import segments

Array = jax.Array
Metrics = dict[str, Array]
Scalar = Union[float, Array]

MAX_LOG_RATIO = 20.0

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                "token_sum_norm")

SAO_ALPHA = 1.5
VAPO_ALPHA = 0.05


# --- Helpers (shared with sao_jax.rl.baselines) ---


def aggregate(x: Array, mask: Array, mode: str = "token_mean", *,
              constant: Optional[float] = None) -> Array:
  """Reduces per-token terms ``x`` [B, T] to a scalar over action tokens.

  Modes:
    token_mean: Σ mask·x / Σ mask over the whole batch (DAPO Yu 2025 token-level
      loss; SAO's DIS loss: every action token counts once, band-rejected ones
      included).
    seq_mean_token_mean: mean over non-empty rows of (Σ_t mask·x / Σ_t mask)
      (GRPO, DeepSeekMath 2024: 1/G Σ_i 1/|o_i| Σ_t).
    seq_mean_token_sum: mean over non-empty rows of Σ_t mask·x.
    token_sum_norm: Σ mask·x / (B · C) with a constant C (``constant``, default
      T) (Dr. GRPO, Liu 2025: no length normalisation, a fixed normaliser).

  Args:
    x: [B, T] per-token terms.
    mask: [B, T] action mask.
    mode: One of ``AGGREGATIONS``.
    constant: C for ``token_sum_norm`` (e.g. the max generation length).

  Returns:
    A float32 scalar; 0 when the mask is empty.
  """
  m = rl_metrics.as_mask(mask)
  if mode == "token_mean":
    return rl_metrics.masked_mean(x, m)
  if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
    row_val = rl_metrics.masked_sum(x, m, axis=-1)
    row_cnt = jnp.sum(m, axis=-1)
    if mode == "seq_mean_token_mean":
      row_val = row_val / jnp.maximum(row_cnt, 1.0)
    nonempty = (row_cnt > 0).astype(jnp.float32)
    return jnp.sum(row_val * nonempty) / jnp.maximum(jnp.sum(nonempty), 1.0)
  if mode == "token_sum_norm":
    c = float(x.shape[-1]) if constant is None else constant
    num_rows = 1 if x.ndim == 1 else x.shape[0]
    return rl_metrics.masked_sum(x, m) / (num_rows * c)
  raise ValueError(
      f"Unknown aggregation mode {mode!r}; use one of {AGGREGATIONS}.")


def prepare(mask: Array, *arrays: Optional[Array]):
  """Float32 mask and arrays with masked-out entries zeroed (None passes)."""
  m = rl_metrics.as_mask(mask)
  return m, [None if a is None else
             jnp.where(m > 0, jnp.asarray(a, jnp.float32), 0.0) for a in arrays]


def clamped_log_ratio(num: Array, den: Array) -> Array:
  """num − den clamped to ±``MAX_LOG_RATIO`` (finite ``exp`` and gradients)."""
  return jnp.clip(num - den, -MAX_LOG_RATIO, MAX_LOG_RATIO)


def ratio_metrics(log_ratio: Array, mask: Array, prefix: str = "") -> Metrics:
  """Ratio mean/min/max and ½E[(log r)²] (k2 KL estimate) over action tokens."""
  r = jnp.exp(log_ratio)
  return {
      f"{prefix}ratio_mean": rl_metrics.masked_mean(r, mask),
      f"{prefix}ratio_min": rl_metrics.masked_min(r, mask),
      f"{prefix}ratio_max": rl_metrics.masked_max(r, mask),
      f"{prefix}kl_k2": 0.5 * rl_metrics.masked_mean(jnp.square(log_ratio),
                                                     mask),
  }


# --- SAO: direct double-sided importance sampling (Eqs. 1-3) ---

# The paper's DIS band for reasoning (Eq. 2): (1 - 0.3, 1 + 5.0).
DIS_EPS_LOW, DIS_EPS_HIGH = 0.3, 5.0


def dis_out_of_band(log_ratio: Array, eps_low: float = DIS_EPS_LOW,
                    eps_high: float = DIS_EPS_HIGH) -> tuple[Array, Array]:
  """(below, above): tokens DIS masks, r <= 1 - eps_low or r >= 1 + eps_high
  (Eq. 2's band is open), from log r = log pi_theta - log pi_rollout."""
  ratio = jnp.exp(log_ratio)
  return ratio <= 1.0 - eps_low, ratio >= 1.0 + eps_high


def dis_policy_loss(logp: Array, rollout_logp: Array, advantages: Array,
                    mask: Array, *, eps_low: float = DIS_EPS_LOW,
                    eps_high: float = DIS_EPS_HIGH,
                    aggregation: str = "token_mean",
                    constant: Optional[float] = None) -> tuple[Array, Metrics]:
  """SAO direct double-sided importance sampling (arXiv 2607.07508, Eqs. 1–3).

  r_t = exp(logp_t − rollout_logp_t), against the *rollout* policy (staleness
  and train/inference mismatch are one ratio; there is no π_old); f(r) = r if
  1−ε_l < r < 1+ε_h else 0 (strict inequalities);
  L = − Σ_t mask_t · sg(f(r_t)·A_t) · logp_t / Σ_t mask_t.
  So ∂L/∂logp_t = −f(r_t)·A_t/N: tokens outside the band get exactly zero
  gradient whatever the sign of A_t, and still count in N (token mean over all
  action tokens).

  Args:
    logp: [B, T] log π_θ (trainer, now).
    rollout_logp: [B, T] log π_rollout recorded by the sampler.
    advantages: [B, T] advantages A_t.
    mask: [B, T] 1 on action tokens.
    eps_low: ε_l, lower band 1−ε_l (paper: 0.3 reasoning, 0.8 coding).
    eps_high: ε_h, upper band 1+ε_h (paper: 5.0 reasoning, 3.0 coding).
    aggregation: see ``aggregate``; the paper's loss is ``token_mean``.
    constant: normaliser for ``token_sum_norm``.

  Returns:
    (loss, metrics) with accept/reject_low/reject_high fractions, ratio
    mean/min/max and kl_k2 = ½E[(log r)²].
  """
  m, (logp, rollout_logp, adv) = prepare(mask, logp, rollout_logp, advantages)
  log_ratio = jax.lax.stop_gradient(clamped_log_ratio(logp, rollout_logp))
  ratio = jnp.exp(log_ratio)
  below, above = dis_out_of_band(log_ratio, eps_low, eps_high)
  accept = jnp.logical_not(below | above)
  weight = jax.lax.stop_gradient(jnp.where(accept, ratio, 0.0) * adv)  # f(r)·A
  loss = -aggregate(weight * logp, m, aggregation, constant=constant)
  metrics = {
      "accept_frac": rl_metrics.masked_mean(accept.astype(jnp.float32), m),
      "reject_low_frac": rl_metrics.masked_mean(below.astype(jnp.float32), m),
      "reject_high_frac": rl_metrics.masked_mean(above.astype(jnp.float32), m),
      **ratio_metrics(log_ratio, m),
  }
  return loss, metrics


# --- Critic: skip-observation and decoupled GAE (Eqs. 4-5), value loss ---


def _per_token(x: Scalar, shape: tuple[int, int]) -> Array:
  """A scalar, per-row [B] or per-token [B, T] coefficient as [B, T]."""
  x = jnp.asarray(x, jnp.float32)
  return jnp.broadcast_to(x[:, None] if x.ndim == 1 else x, shape)


def gae(rewards: Array, values: Array, mask: Array, *, gamma: Scalar = 1.0,
        lam: Scalar = 1.0, segment_ids: Optional[Array] = None
        ) -> tuple[Array, Array]:
  """Skip-observation GAE (SAO arXiv 2607.07508, Eqs. 4–5).

  The recursion runs over action tokens only, jumping observation gaps: for
  action token t with next action token n(t) (the first action token after t,
  across any observation tokens),
    δ_t = r̃_t + γ V(n(t)) − V(t),   Â_t = δ_t + γλ Â(n(t)),
  and the last action token of a row bootstraps with V = Â = 0 (the episode
  ends). Gaps cost no discount. With an all-action mask this is ordinary GAE
  (Schulman 2016).

  Rewards on non-action tokens: a reward on an observation/padding token is
  credited to the closest *preceding* action token (r̃_t = r_t + Σ rewards on
  the non-action tokens between t and n(t)); rewards before a row's first action
  token (on the prompt) are ignored. Values on non-action tokens are never read.

  Args:
    rewards: [B, T] per-token rewards (a terminal reward on the last action
      token).
    values: [B, T] critic values V(t).
    mask: [B, T] 1 on action tokens.
    gamma: discount γ, scalar, per-row [B] or per-token [B, T].
    lam: λ, scalar, per-row [B] or per-token [B, T] (e.g.
      ``length_adaptive_lambda``).
    segment_ids: Packed rows (``rl.segments``): the recursion restarts at
      each segment's end, so no value, advantage or reward crosses from one
      trajectory to another; None: one trajectory per row.

  Returns:
    (advantages, returns), [B, T] float32, with returns = Â + V on action
    tokens; both are 0 on non-action tokens.
  """
  m = rl_metrics.as_mask(mask) > 0
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.where(m, jnp.asarray(values, jnp.float32), 0.0)
  batch = rewards.shape[0]
  gamma = _per_token(gamma, rewards.shape)
  lam = _per_token(lam, rewards.shape)
  ends = (jnp.zeros(rewards.shape, bool) if segment_ids is None
          else segments.segment_ends(segment_ids))

  def step(carry, xs):
    r, v, is_action, gamma, lam, end = xs
    next_v, next_adv, pending = (jnp.where(end, 0.0, c) for c in carry)
    delta = r + pending + gamma * next_v - v
    adv = delta + gamma * lam * next_adv
    carry = (jnp.where(is_action, v, next_v),
             jnp.where(is_action, adv, next_adv),
             jnp.where(is_action, 0.0, pending + r))
    return carry, jnp.where(is_action, adv, 0.0)

  zeros = jnp.zeros((batch,), jnp.float32)
  _, adv_t = jax.lax.scan(step, (zeros, zeros, zeros),
                          (rewards.T, values.T, m.T, gamma.T, lam.T, ends.T),
                          reverse=True)
  advantages = adv_t.T
  returns = jnp.where(m, advantages + values, 0.0)
  return advantages, returns


def length_adaptive_lambda(num_action_tokens: Array,
                           alpha: float = SAO_ALPHA) -> Array:
  """λ_policy = 1 − 1/(α·l), clipped to [0, 1] (VAPO Yue 2025; SAO §3.2, α=1.5).

  ``l`` = a trajectory's number of action tokens; rows with l=0 get 0 (they have
  no action tokens, so λ is never used).
  """
  l = jnp.asarray(num_action_tokens, jnp.float32)
  safe = jnp.where(l > 0, l, 1.0)
  lam = jnp.clip(1.0 - 1.0 / (alpha * safe), 0.0, 1.0)
  return jnp.where(l > 0, lam, 0.0)


def decoupled_gae(rewards: Array, values: Array, mask: Array, *,
                  gamma: Scalar = 1.0, alpha: float = SAO_ALPHA,
                  lam_critic: Scalar = 1.0,
                  segment_ids: Optional[Array] = None,
                  num_slots: int = 1) -> tuple[Array, Array]:
  """Decoupled GAE (VAPO Yue 2025; SAO §3.2): policy and critic use different λ.

  Policy advantages use λ_policy = ``length_adaptive_lambda(l, alpha)`` per row
  (SAO α=1.5, VAPO α=0.05); value targets use λ_critic (default 1: Monte-Carlo
  returns, unbiased). Both use skip-observation ``gae`` (Eqs. 4–5). Packed
  rows (``segment_ids``, up to ``num_slots`` trajectories a row): ``l`` and
  λ_policy are per trajectory.

  Returns:
    (policy_advantages, value_targets), [B, T].
  """
  if segment_ids is None:
    lam_policy = length_adaptive_lambda(
        rl_metrics.masked_count(mask, axis=-1), alpha)
  else:
    num = segments.segment_sum(rl_metrics.as_mask(mask), segment_ids,
                               num_slots)
    lam_policy = segments.to_tokens(length_adaptive_lambda(num, alpha),
                                    segment_ids)
  advantages, _ = gae(rewards, values, mask, gamma=gamma, lam=lam_policy,
                      segment_ids=segment_ids)
  _, returns = gae(rewards, values, mask, gamma=gamma, lam=lam_critic,
                   segment_ids=segment_ids)
  return advantages, returns


def value_loss(values: Array, returns: Array, mask: Array, *,
               old_values: Optional[Array] = None,
               clip: Optional[float] = None) -> tuple[Array, Metrics]:
  """Critic regression loss E[(V − R)²] over action tokens (SAO §3.2).

  Plain MSE **without** a ½ factor (the paper's E[(V−R)²]; gradient 2(V−R)/N).
  With ``old_values`` and ``clip`` (PPO2-style value clipping), the per-token
  loss is max((V−R)², (V_old + clip(V−V_old, −c, c) − R)²). Returns are
  constants (sg).

  Returns:
    (loss, metrics): value_loss, value_mean, return_mean, explained_variance,
    value_clip_frac (clipped variant only).
  """
  m, (values, returns) = prepare(mask, values, returns)
  returns = jax.lax.stop_gradient(returns)
  per_tok = jnp.square(values - returns)
  metrics: Metrics = {}
  if clip is not None:
    if old_values is None:
      raise ValueError("value_loss(clip=...) needs old_values (the critic's "
                       "values at rollout time); pass them or set clip=None.")
    _, (old_values,) = prepare(m, old_values)
    old_values = jax.lax.stop_gradient(old_values)
    v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
    clipped_tok = jnp.square(v_clipped - returns)
    metrics["value_clip_frac"] = rl_metrics.masked_mean(
        (clipped_tok > per_tok).astype(jnp.float32), m)
    per_tok = jnp.maximum(per_tok, clipped_tok)
  loss = rl_metrics.masked_mean(per_tok, m)
  metrics.update({
      "value_loss": loss,
      "value_mean": rl_metrics.masked_mean(values, m),
      "return_mean": rl_metrics.masked_mean(returns, m),
      "explained_variance": rl_metrics.explained_variance(
          jax.lax.stop_gradient(values), returns, m),
  })
  return loss, metrics
