"""The SAO train step: critic updates, advantages, one policy update.

The math is docs/design/math.md.

Per batch of single-rollout trajectories ``[B, T]``:

1. The critic (``ValueModel``) scores every token; the value of action token t
   is the critic's output at position t−1 (the state before t was sampled).
2. Advantages and value targets come from the estimator the loss is
   registered with (``LossSpec.advantage``) unless the config names another
   (``rl.advantage``, e.g. the DIS-only ablation's plain GAE); SAO's is
   decoupled skip-observation GAE (λ_critic for targets, λ_policy = 1 − 1/(α·l)
   for advantages, Eqs. 4–5; ``rl/losses.py``), computed once from the
   pre-update critic. Every estimator is an entry of ``rl/advantages.py``'s
   table; the step looks it up (``compute_advantages``).
3. ``critic_updates_per_step`` critic steps on the value loss ("faster value
   update", paper §3.2), optionally with attention frozen (masked updates).
4. Unless still in critic warm-up, one policy step on the registered loss
   (SAO: DIS against the sampler's rollout log-probs, Eqs. 1–3), called as
   ``registry.get_loss_fn`` returns it, on a ``registry.PolicyBatch``, with the
   trainer's log-probs computed at the sampler's temperature. Policy version
   = number of policy optimizer steps.

With ``TrainState.ref_params`` (the initial policy, kept when ``kl_coef`` > 0)
the PPO/GRPO losses also get ``ref_logp``, the reference policy's log-probs,
for their k3 KL penalty.

Losses that need π_old (PPO/GRPO family) get ``old_logp = sg(logp)``: one
update per batch, π_old is the trainer's current policy, as in verl/OpenRLHF
with a single mini-batch. Their staleness is therefore *not* corrected: that
is the point of the GRPO-vs-DIS comparison.

A step whose losses, gradient norms or updated parameters are not finite is
skipped inside the jitted step: parameters, optimizer states and the policy
version stay as they were (only ``step`` advances), and the metric
``health/skipped`` is 1. The loop counts skips and stops a run that keeps
producing them (``sao_jax.train.health``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
import optax

from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.rl import advantages as adv_lib
from sao_jax.rl import losses as loss_lib
from sao_jax.rl import metrics as rl_metrics
from sao_jax.rl import registry
from sao_jax.rl import segments

Array = jax.Array
Batch = Mapping[str, Array]


@flax.struct.dataclass
class TrainState:
  """Everything the step changes. ``step`` counts train steps (batches),

  ``policy_version`` counts policy optimizer steps (docs/design/data_path.md
  "Staleness")."""

  step: Array
  policy_version: Array
  policy_params: Any
  value_params: Any
  policy_opt_state: Any
  value_opt_state: Any
  running_mean: adv_lib.RunningMeanState | None = None
  # Frozen reference policy for the k3 KL penalty (losses with ``kl_coef``);
  # None when no KL is asked for.
  ref_params: Any = None


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of the step (hashable: part of the jit cache key).

  Attributes:
    loss: Registered loss name (``sao_jax.rl.registry``).
    loss_hparams: Sorted (key, value) pairs overriding the loss defaults.
    advantage: Estimator name (``advantages.available_advantages()``); None:
      the one the loss is registered with (``registry.LossSpec.advantage``).
    gamma: Discount.
    lam_critic: λ for value targets (and for plain 'gae' advantages).
    lam_policy_alpha: α of the length-adaptive λ_policy (decoupled_gae).
    critic_updates_per_step: K critic steps per train step.
    temperature: Sampling temperature (log-probs use logits / T).
    value_clip: Optional clipped value loss range.
    max_groups: Static bound on groups per batch (group estimators).
    running_mean_global: 'running_mean' over the last k rewards of all
      prompts (one table row; the online simulation) instead of per prompt.
    routing_replay: A MoE policy's forward uses the experts the sampler
      recorded (batch['routed_experts']; R3) instead of routing on its own.
    router_aux_loss_coef: Weight of the MoE load-balancing loss in the
      policy loss.
  """

  loss: str = "sao"
  loss_hparams: tuple[tuple[str, Any], ...] = ()
  advantage: str | None = None
  gamma: float = 1.0
  lam_critic: float = 1.0
  lam_policy_alpha: float = loss_lib.SAO_ALPHA
  critic_updates_per_step: int = 2
  temperature: float = 1.0
  value_clip: float | None = None
  max_groups: int = 1
  running_mean_global: bool = False
  routing_replay: bool = False
  router_aux_loss_coef: float = 0.0

  def __post_init__(self):
    registry.get_spec(self.loss)  # Each raises listing the known names.
    adv_lib.get_advantage(self.estimator)

  @property
  def estimator(self) -> str:
    """The advantage estimator used: ``advantage``, else the loss's pairing."""
    if self.advantage is not None:
      return self.advantage
    return registry.get_spec(self.loss).advantage

  @property
  def uses_reference(self) -> bool:
    """Whether the loss has a KL penalty to a reference policy switched on."""
    return bool(dict(self.loss_hparams).get("kl_coef") or 0.0)

  @property
  def uses_critic(self) -> bool:
    return adv_lib.get_advantage(self.estimator).uses_critic

  def loss_fn(self) -> registry.LossFn:
    """``fn(logp, registry.PolicyBatch) -> (loss, metrics)``, hparams bound."""
    return registry.get_loss_fn(self.loss, dict(self.loss_hparams))


def _model_inputs(batch: Batch) -> tuple[Array, dict[str, Array]]:
  """Positions and the segment keywords of the model call.

  Packed rows (``data.packing``) bring their own positions (restarting per
  trajectory) and ``segment_ids``; unpacked rows get positions from the
  attention mask and no segment ids (one trajectory per row).
  """
  if "segment_ids" in batch:
    return batch["positions"], {"segment_ids": batch["segment_ids"]}
  return transformer.positions_from_mask(batch["attention_mask"]), {}


def _segment_ids(batch: Batch) -> Array:
  """The rows' segment ids; an unpacked row is one segment (its tokens)."""
  if "segment_ids" in batch:
    return batch["segment_ids"]
  return batch["attention_mask"].astype(jnp.int32)


def _aligned_values(critic: transformer.ValueModel, params: Any,
                    batch: Batch) -> Array:
  """V of the state before each token: critic output shifted right by one,
  never across a trajectory boundary (0 on each trajectory's first token)."""
  positions, seg = _model_inputs(batch)
  v = critic.apply({"params": params}, batch["tokens"], positions,
                   batch["attention_mask"], **seg)
  return segments.shift_right_within(v, _segment_ids(batch))


def _policy_logp(policy: transformer.Transformer, params: Any, batch: Batch,
                 temperature: float, replay: bool = False
                 ) -> tuple[Array, Array, dict[str, Array]]:
  """Trainer log-probs of each token (at the sampler's temperature), entropy
  and, for a MoE policy, its routing (`logprobs.policy_token_stats`).

  One log-softmax over the vocabulary gives both, in chunks of
  ``model.logits_chunk`` tokens when set (``models.logprobs``); out[:, t] is
  about token t given its prefix, 0 at t = 0 and on the first token of each
  packed trajectory. With ``replay`` the forward uses the sampler's recorded
  experts (R3).
  """
  positions, seg = _model_inputs(batch)
  if replay:
    seg["routing"] = batch["routed_experts"]
  stats = logprobs_lib.policy_token_stats(
      params, policy.config, batch["tokens"], positions,
      batch["attention_mask"], temperature=temperature, **seg)
  logp, ent = stats["logp"], stats["entropy"]
  moe = {k: v for k, v in stats.items() if k.startswith("moe_")}
  if "segment_ids" not in batch:
    return logp, ent, moe
  starts = segments.segment_starts(batch["segment_ids"])
  return jnp.where(starts, 0.0, logp), jnp.where(starts, 0.0, ent), moe


def compute_advantages(cfg: StepConfig, batch: Batch, values: Array,
                       running_mean: adv_lib.RunningMeanState | None
                       ) -> tuple[Array, Array, Any]:
  """(policy advantages, value targets, new running-mean state) of the
  estimator ``cfg.estimator`` names (``advantages.get_advantage``)."""
  rollouts = adv_lib.Rollouts.of(batch, values)
  adv, running_mean = adv_lib.get_advantage(cfg.estimator).fn(
      cfg, rollouts, running_mean)
  return adv, adv_lib.critic_gae(cfg, rollouts)[1], running_mean


def _critic_update(critic, tx, cfg: StepConfig, state: TrainState,
                   batch: Batch, returns: Array, old_values: Array):
  mask = batch["action_mask"]

  def loss_fn(p):
    values = _aligned_values(critic, p, batch)
    loss, m = loss_lib.value_loss(values, returns, mask,
                                  old_values=old_values, clip=cfg.value_clip)
    return loss, m

  (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.value_params)
  updates, opt_state = tx.update(grads, state.value_opt_state,
                                 state.value_params)
  state = state.replace(value_params=optax.apply_updates(state.value_params,
                                                         updates),
                        value_opt_state=opt_state)
  metrics = {f"critic/{k}": v for k, v in m.items()}
  metrics["critic/loss"] = loss
  metrics["critic/grad_norm"] = optax.global_norm(grads)
  return state, metrics


def _policy_update(policy, tx, cfg: StepConfig, loss_fn: registry.LossFn,
                   state: TrainState, batch: Batch, adv: Array):
  mask = batch["action_mask"]
  ref_logp = None
  if state.ref_params is not None:
    ref_logp = jax.lax.stop_gradient(_policy_logp(
        policy, state.ref_params, batch, cfg.temperature,
        cfg.routing_replay)[0])

  def objective(p):
    logp, ent, moe = _policy_logp(policy, p, batch, cfg.temperature,
                                  cfg.routing_replay)
    sg = jax.lax.stop_gradient(logp)
    loss, m = loss_fn(logp, registry.PolicyBatch(
        rollout_logp=batch["rollout_logp"], advantages=adv, mask=mask,
        old_logp=sg, prox_logp=sg, ref_logp=ref_logp))
    m = dict(m)
    m["entropy"] = rl_metrics.masked_mean(ent, mask)
    # The train/inference mismatch DIS masks (and routing replay narrows).
    m["logp_abs_diff"] = rl_metrics.masked_mean(
        jnp.abs(sg - batch["rollout_logp"]), mask)
    # What the paper's DIS band would mask, whatever the loss (an arm
    # without DIS reports the mismatch it trains through).
    below, above = loss_lib.dis_out_of_band(
        loss_lib.clamped_log_ratio(sg, batch["rollout_logp"]))
    m["dis_band_out_frac"] = rl_metrics.masked_mean(
        (below | above).astype(jnp.float32), mask)
    if moe:
      m.update(_moe_metrics(moe, batch))
      loss = loss + cfg.router_aux_loss_coef * moe["moe_aux_loss"]
    return loss, m

  (loss, m), grads = jax.value_and_grad(objective, has_aux=True)(
      state.policy_params)
  updates, opt_state = tx.update(grads, state.policy_opt_state,
                                 state.policy_params)
  state = state.replace(
      policy_params=optax.apply_updates(state.policy_params, updates),
      policy_opt_state=opt_state,
      policy_version=state.policy_version + 1)
  metrics = {f"policy/{k}": v for k, v in m.items()}
  metrics["policy/loss"] = loss
  metrics["policy/grad_norm"] = optax.global_norm(grads)
  return state, metrics


def _moe_metrics(moe: Mapping[str, Array], batch: Batch) -> dict[str, Array]:
  """The router's load-balancing loss and, where the sampler recorded its
  routing, the fraction of (token, MoE layer) pairs whose expert sets the
  trainer's own router agrees with."""
  out = {"moe_aux_loss": moe["moe_aux_loss"]}
  if "routed_experts" in batch:
    own = jnp.sort(moe["moe_own_experts"], axis=-1)
    recorded = jnp.sort(batch["routed_experts"].astype(jnp.int32), axis=-1)
    same = jnp.all(own == recorded, axis=-1).astype(jnp.float32)  # [B,T,M]
    real = batch["attention_mask"].astype(jnp.float32)[..., None]
    out["routing_agreement"] = jnp.sum(same * real) / jnp.maximum(
        jnp.sum(real) * same.shape[-1], 1.0)
  return out


def _is_finite(metrics: Mapping[str, Array], new_state: TrainState) -> Array:
  """Whether every loss, gradient norm and updated parameter is finite.

  The per-leaf flags meet in one int32 min, not a `jnp.all`: XLA turns an
  `all` over stacked scalars into a chain of scalar ands and copies that
  chain into every leaf's select fusion below (the Qwen3.5 hybrid's tiny
  CPU step: 179k lines of HLO and 24 CPU-s to compile that way, 59k and 13
  this way).
  """
  checked = [v for k, v in metrics.items()
             if k.endswith("loss") or k.endswith("grad_norm")]
  checked += [p for p in jax.tree.leaves(
      (new_state.policy_params, new_state.value_params))
              if jnp.issubdtype(p.dtype, jnp.inexact)]
  flags = jnp.stack([jnp.all(jnp.isfinite(x)) for x in checked])
  return jnp.min(flags.astype(jnp.int32)) > 0


def train_step(state: TrainState, batch: Batch, *, model_config: ModelConfig,
               cfg: StepConfig, policy_tx: optax.GradientTransformation,
               value_tx: optax.GradientTransformation,
               loss_fn: registry.LossFn, update_policy: bool) -> tuple[TrainState, dict[str, Array]]:
  """One SAO step (see module docstring). Pure; jit it with ``make_step``."""
  old_state = state
  policy = transformer.Transformer(model_config)
  critic = transformer.ValueModel(model_config)
  mask = batch["action_mask"].astype(jnp.float32)
  metrics: dict[str, Array] = {}
  if cfg.uses_critic:
    values = jax.lax.stop_gradient(
        _aligned_values(critic, state.value_params, batch))
  else:
    values = jnp.zeros_like(mask)
  adv, returns, running_mean = compute_advantages(cfg, batch, values,
                                                 state.running_mean)
  adv = jax.lax.stop_gradient(adv)
  if cfg.uses_critic:
    # K critic steps as one traced body in a scan: the program holds the
    # critic's forward and backward once, whatever K (tracing and compile
    # time, and temporaries, of one update). The last step's metrics count.
    def critic_step(s, _):
      return _critic_update(critic, value_tx, cfg, s, batch, returns, values)
    state, per_step = jax.lax.scan(critic_step, state, None,
                                   length=cfg.critic_updates_per_step)
    metrics = jax.tree.map(lambda m: m[-1], per_step)
  if update_policy:
    state, pm = _policy_update(policy, policy_tx, cfg, loss_fn, state, batch,
                               adv)
    metrics.update(pm)
  state = state.replace(running_mean=running_mean)
  seq_reward, valid, _ = adv_lib.trajectory_rewards(batch,
                                                    batch["rewards"] * mask)
  real = batch["attention_mask"].astype(jnp.float32)
  metrics.update({
      "reward/mean": (seq_reward.mean() if valid is None
                      else rl_metrics.masked_mean(seq_reward, valid)),
      "batch/trajectories": (jnp.float32(seq_reward.size) if valid is None
                             else valid.sum().astype(jnp.float32)),
      "batch/padding_frac": 1.0 - real.mean(),
      "advantage/mean": rl_metrics.masked_mean(adv, mask),
      "advantage/std": jnp.sqrt(rl_metrics.masked_var(adv, mask)),
      "returns/mean": rl_metrics.masked_mean(returns, mask),
      "tokens/action": mask.sum(),
  })
  # Skip a non-finite update: keep every leaf of the old state.
  finite = _is_finite(metrics, state)
  state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), state,
                       old_state)
  metrics["health/skipped"] = 1.0 - finite.astype(jnp.float32)
  return state.replace(step=old_state.step + 1), metrics


def make_step(model_config: ModelConfig, cfg: StepConfig,
              policy_tx: optax.GradientTransformation,
              value_tx: optax.GradientTransformation, *,
              update_policy: bool,
              state_sharding: Any = None, batch_sharding: Any = None
              ) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """``jax.jit(train_step)`` with shardings and the state donated; the loss
  is resolved here, once (``StepConfig.loss_fn``)."""
  fn = functools.partial(train_step, model_config=model_config, cfg=cfg,
                         policy_tx=policy_tx, value_tx=value_tx,
                         loss_fn=cfg.loss_fn(),
                         update_policy=update_policy)
  kwargs = {}
  if state_sharding is not None:
    kwargs["in_shardings"] = (state_sharding, batch_sharding)
    kwargs["out_shardings"] = (state_sharding, None)
  return jax.jit(fn, donate_argnums=0, **kwargs)


def create_train_state(policy_params: Any, value_params: Any,
                       policy_tx: optax.GradientTransformation,
                       value_tx: optax.GradientTransformation, *,
                       running_mean: adv_lib.RunningMeanState | None = None,
                       ref_params: Any = None) -> TrainState:
  """A fresh state at step 0, policy version 0 (params must be unboxed).

  ``ref_params``: the frozen reference policy of the KL penalty (a copy of
  the initial policy), or None for no KL.
  """
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      policy_version=jnp.zeros((), jnp.int32),
      policy_params=policy_params,
      value_params=value_params,
      policy_opt_state=policy_tx.init(policy_params),
      value_opt_state=value_tx.init(value_params),
      running_mean=running_mean, ref_params=ref_params)
