"""The losses of the methods SAO is compared with (its ablations' baselines).

PPO clip with its variants (dual clip, GRPO, Dr. GRPO, DAPO, VAPO,
REINFORCE++ are ``ppo_clip_loss`` with their settings in
``sao_jax.rl.registry``), GSPO, CISPO, AReaL's decoupled PPO and the
train/inference-mismatch corrections TIS and IcePop, with the helpers only
they use (the clipped surrogate, the k3 KL to a reference policy). SAO's own
loss is ``sao_jax.rl.losses``, whose helpers and conventions these follow
(masked inputs zeroed first, clamped log-ratios, explicit aggregation).

Inputs besides those of ``sao_jax.rl.losses``: ``old_logp`` / ``prox_logp``,
a trainer-side snapshot (PPO's π_old, AReaL's proximal policy; constants),
and ``ref_logp``, a reference policy for the KL penalty.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from sao_jax.rl import losses
from sao_jax.rl import metrics as rl_metrics

Array = jax.Array
Metrics = losses.Metrics


# --- The PPO family: clipped surrogates, optional KL to a reference ---


def _clipped_surrogate(ratio: Array, adv: Array, eps_low: float,
                       eps_high: float):
  """min(r·A, clip(r, 1−ε_l, 1+ε_h)·A) and where the clipped branch is active.

  PPO (Schulman 2017, Eq. 7) with asymmetric ε (clip-higher, DAPO Yu 2025).
  """
  unclipped_obj = ratio * adv
  clipped_obj = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
  return jnp.minimum(unclipped_obj, clipped_obj), clipped_obj < unclipped_obj


def k3_kl(logp: Array, ref_logp: Array) -> Array:
  """Per-token k3 estimator of KL(π_θ‖π_ref) = exp(ref−logp) − (ref−logp) − 1.

  GRPO (DeepSeekMath 2024, Eq. 4); unbiased, non-negative. Log-ratio clamped to
  ±20.
  """
  d = losses.clamped_log_ratio(ref_logp, logp)
  return jnp.exp(d) - d - 1.0


def _with_kl(loss: Array, metrics: Metrics, logp: Array, ref_logp, mask: Array,
             kl_coef, aggregation: str, constant) -> Array:
  """Adds kl_coef · aggregate(k3) when a reference policy is given."""
  if ref_logp is None or kl_coef is None:
    return loss
  if isinstance(kl_coef, (int, float)) and kl_coef == 0:
    return loss
  _, (ref_logp,) = losses.prepare(mask, ref_logp)
  kl = losses.aggregate(k3_kl(logp, ref_logp), mask, aggregation,
                        constant=constant)
  metrics["kl_ref_k3"] = kl
  metrics["pg_loss"] = loss
  return loss + kl_coef * kl


def ppo_clip_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array,
                  *, eps_low: float = 0.2, eps_high: float = 0.2,
                  dual_clip: Optional[float] = None,
                  aggregation: str = "token_mean",
                  constant: Optional[float] = None,
                  ref_logp: Optional[Array] = None,
                  kl_coef: float = 0.0) -> tuple[Array, Metrics]:
  """PPO clipped surrogate (Schulman 2017, Eq. 7), optional dual clip and k3 KL.

  r = exp(logp − old_logp); L = −agg(min(r·A, clip(r, 1−ε_l, 1+ε_h)·A)). Only
  (A>0, r>1+ε_h) and (A<0, r<1−ε_l) are clipped: unlike DIS, a token with A>0
  and r<1−ε_l (or A<0 and r>1+ε_h) still gets gradient −r·A/N.

  With ``dual_clip=c`` (> 1; Ye et al. 2020, "Mastering Complex Control in MOBA
  Games"), tokens with A<0 use max(min(r·A, clip(r)·A), c·A): r > c gets no
  gradient. With ``ref_logp`` and ``kl_coef`` > 0, adds kl_coef·agg(k3 KL)
  (GRPO-style). The registry's dual-clip PPO, GRPO, Dr. GRPO, DAPO, VAPO and
  REINFORCE++ are this function with their settings.

  Returns:
    (loss, metrics): clip_frac (clipped branch active), dual_clip_frac, ratio
    mean/min/max, kl_k2.
  """
  m, (logp, old_logp, adv) = losses.prepare(mask, logp, old_logp, advantages)
  log_ratio = losses.clamped_log_ratio(logp, jax.lax.stop_gradient(old_logp))
  adv = jax.lax.stop_gradient(adv)
  ratio = jnp.exp(log_ratio)
  surr, is_clipped = _clipped_surrogate(ratio, adv, eps_low, eps_high)
  metrics: Metrics = {}
  if dual_clip is not None:
    if isinstance(dual_clip, (int, float)) and dual_clip <= 1.0:
      raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); e.g. 3.0.")
    lower = dual_clip * adv
    dual_active = (adv < 0) & (lower > surr)
    surr = jnp.where(adv < 0, jnp.maximum(surr, lower), surr)
    metrics["dual_clip_frac"] = rl_metrics.masked_mean(
        dual_active.astype(jnp.float32), m)
  loss = -losses.aggregate(surr, m, aggregation, constant=constant)
  metrics["clip_frac"] = rl_metrics.masked_mean(
      is_clipped.astype(jnp.float32), m)
  metrics.update(losses.ratio_metrics(jax.lax.stop_gradient(log_ratio), m))
  loss = _with_kl(loss, metrics, logp, ref_logp, m, kl_coef, aggregation,
                  constant)
  return loss, metrics


def gspo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
              eps_low: float = 3e-4, eps_high: float = 4e-4
              ) -> tuple[Array, Metrics]:
  """GSPO (Zheng et al. 2025): sequence-level geometric-mean ratio and clip.

  s_i = exp(1/|y_i| Σ_t mask·(logp − old_logp)), the length-normalised sequence
  importance ratio. Implemented as the paper's GSPO-token variant: s_{i,t} =
  sg(s_i)·π_θ(y_t)/sg(π_θ(y_t)), whose value is s_i and whose gradient is
  s_i·∇logp_t, aggregated 1/G Σ_i 1/|y_i| Σ_t min(s_{i,t}A_t, clip(s_{i,t})A_t).
  With a per-sequence advantage this is exactly GSPO; it also accepts
  token-level advantages. Defaults ε 3e-4/4e-4 as in the paper.

  Returns:
    (loss, metrics): clip_frac (token fraction on the clipped branch),
    seq_out_of_band_frac (fraction of non-empty sequences with s_i outside the
    band), sequence ratio mean/min/max, token kl_k2.
  """
  m, (logp, old_logp, adv) = losses.prepare(mask, logp, old_logp, advantages)
  adv = jax.lax.stop_gradient(adv)
  tok_log_ratio = logp - jax.lax.stop_gradient(old_logp)
  n = jnp.sum(m, axis=-1)
  seq_log_ratio = jnp.sum(tok_log_ratio * m, axis=-1) / jnp.maximum(n, 1.0)
  seq_log_ratio = jnp.clip(seq_log_ratio, -losses.MAX_LOG_RATIO,
                           losses.MAX_LOG_RATIO)
  s = jnp.exp(jax.lax.stop_gradient(seq_log_ratio))  # [B]
  s_tok = s[:, None] * jnp.exp(logp - jax.lax.stop_gradient(logp))
  surr, is_clipped = _clipped_surrogate(s_tok, adv, eps_low, eps_high)
  loss = -losses.aggregate(surr, m, "seq_mean_token_mean")
  nonempty = (n > 0).astype(jnp.float32)
  seq_clipped = ((s < 1.0 - eps_low) | (s > 1.0 + eps_high)).astype(jnp.float32)
  metrics = {
      "clip_frac": rl_metrics.masked_mean(is_clipped.astype(jnp.float32), m),
      "seq_out_of_band_frac": rl_metrics.masked_mean(seq_clipped, nonempty),
      "seq_ratio_mean": rl_metrics.masked_mean(s, nonempty),
      "seq_ratio_min": rl_metrics.masked_min(s, nonempty),
      "seq_ratio_max": rl_metrics.masked_max(s, nonempty),
      "kl_k2": 0.5 * rl_metrics.masked_mean(
          jnp.square(jax.lax.stop_gradient(tok_log_ratio)), m),
  }
  return loss, metrics


def cispo_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array, *,
               eps_low: float = 1.0, eps_high: float = 0.28
               ) -> tuple[Array, Metrics]:
  """CISPO (MiniMax-M1, 2025): −Σ mask·sg(clip(r))·A·logp / Σ mask.

  Clips the importance-sampling *weight*, not the update: every token keeps a
  gradient −clip(r)·A/N (contrast DIS, which zeroes out-of-band tokens).
  MiniMax-M1 imposes no lower bound (ε_l large; the default 1.0 clips at 0) and
  tunes ε_h; the default 0.28 here borrows DAPO's clip-higher.
  """
  m, (logp, old_logp, adv) = losses.prepare(mask, logp, old_logp, advantages)
  log_ratio = jax.lax.stop_gradient(losses.clamped_log_ratio(logp, old_logp))
  ratio = jnp.exp(log_ratio)
  weight = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  is_clipped = weight != ratio
  loss = -losses.aggregate(jax.lax.stop_gradient(weight * adv) * logp, m,
                           "token_mean")
  metrics = {
      "clip_frac": rl_metrics.masked_mean(is_clipped.astype(jnp.float32), m),
      **losses.ratio_metrics(log_ratio, m),
  }
  return loss, metrics


def areal_loss(logp: Array, prox_logp: Array, rollout_logp: Array,
               advantages: Array, mask: Array, *, eps_low: float = 0.2,
               eps_high: float = 0.2, behav_weight_cap: Optional[float] = None
               ) -> tuple[Array, Metrics]:
  """AReaL decoupled PPO (Fu et al. 2025): behaviour vs proximal policy.

  L = −agg_token_mean( w · min(u·A, clip(u, 1−ε_l, 1+ε_h)·A) ) with
  w = sg(π_prox/π_behav) = exp(prox_logp − rollout_logp) (optionally capped at
  ``behav_weight_cap``; tokens above the cap are dropped, w=0, as AReaL does)
  and u = π_θ/π_prox. The trust region is centred on the recent proximal policy,
  while the off-policy correction goes back to the (stale) behaviour policy.
  """
  m, (logp, prox_logp, rollout_logp, adv) = losses.prepare(
      mask, logp, prox_logp, rollout_logp, advantages)
  adv = jax.lax.stop_gradient(adv)
  prox_logp = jax.lax.stop_gradient(prox_logp)
  behav_log_w = losses.clamped_log_ratio(
      prox_logp, jax.lax.stop_gradient(rollout_logp))
  w = jnp.exp(behav_log_w)
  metrics: Metrics = {}
  if behav_weight_cap is not None:
    over = w > behav_weight_cap
    w = jnp.where(over, 0.0, w)
    metrics["behav_weight_capped_frac"] = rl_metrics.masked_mean(
        over.astype(jnp.float32), m)
  log_u = losses.clamped_log_ratio(logp, prox_logp)
  u = jnp.exp(log_u)
  surr, is_clipped = _clipped_surrogate(u, adv, eps_low, eps_high)
  loss = -losses.aggregate(w * surr, m, "token_mean")
  metrics.update({
      "clip_frac": rl_metrics.masked_mean(is_clipped.astype(jnp.float32), m),
      "behav_weight_mean": rl_metrics.masked_mean(w, m),
      **losses.ratio_metrics(jax.lax.stop_gradient(log_u), m),
  })
  return loss, metrics


def _mismatch_ppo(logp, old_logp, rollout_logp, advantages, mask, eps_low,
                  eps_high, weight_fn):
  """PPO clip against π_old times a per-token train/inference mismatch."""
  m, (logp, rollout_logp, adv) = losses.prepare(mask, logp, rollout_logp,
                                                advantages)
  if old_logp is None:
    old_logp = jax.lax.stop_gradient(logp)
  else:
    _, (old_logp,) = losses.prepare(m, old_logp)
  old_logp = jax.lax.stop_gradient(old_logp)
  adv = jax.lax.stop_gradient(adv)
  mismatch_log = losses.clamped_log_ratio(
      old_logp, jax.lax.stop_gradient(rollout_logp))
  k = jnp.exp(mismatch_log)
  w, w_metrics = weight_fn(k, m)
  w = jax.lax.stop_gradient(w)
  log_ratio = losses.clamped_log_ratio(logp, old_logp)
  surr, is_clipped = _clipped_surrogate(jnp.exp(log_ratio), adv, eps_low,
                                        eps_high)
  loss = -losses.aggregate(w * surr, m, "token_mean")
  metrics = {
      "clip_frac": rl_metrics.masked_mean(is_clipped.astype(jnp.float32), m),
      **losses.ratio_metrics(jax.lax.stop_gradient(log_ratio), m),
      **losses.ratio_metrics(mismatch_log, m, prefix="mismatch_"),
      **w_metrics,
  }
  return loss, metrics


def tis_loss(logp: Array, rollout_logp: Array, advantages: Array, mask: Array,
             *, old_logp: Optional[Array] = None, eps_low: float = 0.2,
             eps_high: float = 0.2, cap: float = 2.0) -> tuple[Array, Metrics]:
  """Truncated importance sampling for train/inference mismatch (Yao 2025).

  PPO clip against π_old (trainer-side; ``old_logp``, or sg(logp) when absent,
  i.e. one on-policy step) times w = sg(min(π_old/π_rollout, C)), C=``cap``
  (paper: 2).
  """

  def weight_fn(k, m):
    return jnp.minimum(k, cap), {"tis_truncated_frac": rl_metrics.masked_mean(
        (k > cap).astype(jnp.float32), m)}

  return _mismatch_ppo(logp, old_logp, rollout_logp, advantages, mask, eps_low,
                       eps_high, weight_fn)


def icepop_loss(logp: Array, rollout_logp: Array, advantages: Array,
                mask: Array, *, old_logp: Optional[Array] = None,
                eps_low: float = 0.2, eps_high: float = 0.28,
                mismatch_low: float = 0.5, mismatch_high: float = 5.0
                ) -> tuple[Array, Metrics]:
  """IcePop (Ling team 2025, Ring-1T): masked train/inference mismatch fix.

  k = π_old/π_rollout; M(k) = k if α ≤ k ≤ β else 0 (α=0.5, β=5); L =
  −agg_token_mean( sg(M(k)) · min(r·A, clip(r)·A)) with r = π_θ/π_old (π_old =
  sg(π_θ) when ``old_logp`` is absent). Tokens with too much mismatch get no
  gradient.
  """

  def weight_fn(k, m):
    keep = (k >= mismatch_low) & (k <= mismatch_high)
    return jnp.where(keep, k, 0.0), {
        "icepop_masked_frac": rl_metrics.masked_mean(
            jnp.logical_not(keep).astype(jnp.float32), m)}

  return _mismatch_ppo(logp, old_logp, rollout_logp, advantages, mask, eps_low,
                       eps_high, weight_fn)
