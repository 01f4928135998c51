"""Config name → policy loss, with one call signature for every algorithm.

A config string picks the algorithm (DESIGN.md §2 "Baselines for ablations"):

  loss_fn = registry.get_loss_fn(config.loss.name, config.loss)
  loss, metrics = loss_fn(logp, registry.PolicyBatch(rollout_logp=..., ...))

Every registered function takes ``(logp, batch: PolicyBatch)``; hyperparameters
come from the algorithm's defaults overridden by any matching key of the config
(keys an algorithm does not use are ignored, ``None`` means "keep the default").
Each entry also names the advantage estimator it is meant to be paired with
(``LossSpec.advantage``; see ``sao_jax.rl.advantages``), for the trainer to
read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax.struct
import jax

from sao_jax.rl import losses

Array = jax.Array


@flax.struct.dataclass
class PolicyBatch:
  """The per-token arrays a policy loss needs ([B, T] each; None if absent).

  Attributes:
    rollout_logp: log π_rollout recorded by the sampler (behaviour policy).
    advantages: per-token advantages (constants).
    mask: 1 on action tokens, 0 on prompt / padding / observations.
    old_logp: log π_old of a trainer-side snapshot (PPO, GRPO, DAPO, GSPO,
      CISPO, TIS, IcePop). Where an algorithm needs π_old and it is absent, the
      ratio is taken against ``rollout_logp`` (PPO family) or against sg(logp)
      (TIS/IcePop).
    prox_logp: log π_prox, AReaL's proximal policy (falls back to old_logp).
    ref_logp: log π_ref for the optional k3 KL penalty (PPO/GRPO).
  """

  rollout_logp: Array
  advantages: Array
  mask: Array
  old_logp: Optional[Array] = None
  prox_logp: Optional[Array] = None
  ref_logp: Optional[Array] = None


LossFn = Callable[..., tuple[Array, dict[str, Array]]]


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered algorithm: adapter, default hparams, advantage estimator."""

  fn: LossFn
  defaults: Mapping[str, Any]
  advantage: str
  description: str


def _old(batch: PolicyBatch) -> Array:
  return batch.rollout_logp if batch.old_logp is None else batch.old_logp


def _dis(logp, batch, **hp):
  return losses.dis_policy_loss(logp, batch.rollout_logp, batch.advantages,
                                batch.mask, **hp)


def _ppo(logp, batch, **hp):
  return losses.ppo_clip_loss(logp, _old(batch), batch.advantages, batch.mask,
                              ref_logp=batch.ref_logp, **hp)


def _dual_clip(logp, batch, **hp):
  return losses.dual_clip_ppo_loss(logp, _old(batch), batch.advantages,
                                   batch.mask, **hp)


def _grpo(logp, batch, **hp):
  return losses.grpo_loss(logp, _old(batch), batch.advantages, batch.mask,
                          ref_logp=batch.ref_logp, **hp)


def _dr_grpo(logp, batch, **hp):
  return losses.dr_grpo_loss(logp, _old(batch), batch.advantages, batch.mask,
                             **hp)


def _dapo(logp, batch, **hp):
  return losses.dapo_loss(logp, _old(batch), batch.advantages, batch.mask, **hp)


def _gspo(logp, batch, **hp):
  return losses.gspo_loss(logp, _old(batch), batch.advantages, batch.mask, **hp)


def _cispo(logp, batch, **hp):
  return losses.cispo_loss(logp, _old(batch), batch.advantages, batch.mask,
                           **hp)


def _areal(logp, batch, **hp):
  prox = batch.prox_logp if batch.prox_logp is not None else batch.old_logp
  if prox is None:
    raise ValueError(
        "The 'areal' loss needs the proximal policy's log-probs: set "
        "PolicyBatch.prox_logp (or old_logp) to log π_prox recomputed by the "
        "trainer before the update.")
  return losses.areal_loss(logp, prox, batch.rollout_logp, batch.advantages,
                           batch.mask, **hp)


def _tis(logp, batch, **hp):
  return losses.tis_loss(logp, batch.rollout_logp, batch.advantages,
                         batch.mask, old_logp=batch.old_logp, **hp)


def _icepop(logp, batch, **hp):
  return losses.icepop_loss(logp, batch.rollout_logp, batch.advantages,
                            batch.mask, old_logp=batch.old_logp, **hp)


_DIS_HP = {"eps_low": 0.3, "eps_high": 5.0}
_CLIP = {"eps_low": 0.2, "eps_high": 0.2}
_CLIP_HIGHER = {"eps_low": 0.2, "eps_high": 0.28}

_REGISTRY: dict[str, LossSpec] = {
    "sao": LossSpec(_dis, _DIS_HP, "decoupled_gae",
                    "SAO: DIS (Eqs. 1-3) + critic with decoupled GAE"),
    "dis": LossSpec(_dis, _DIS_HP, "decoupled_gae", "alias of 'sao'"),
    "grpo_dis": LossSpec(_dis, _DIS_HP, "group_zscore",
                         "DIS loss with GRPO group z-score advantages"),
    "ppo": LossSpec(_ppo, {**_CLIP, "kl_coef": 0.0}, "gae",
                    "PPO clip (Schulman 2017)"),
    "dual_clip_ppo": LossSpec(_dual_clip, {**_CLIP, "dual_clip": 3.0}, "gae",
                              "dual-clip PPO (Ye 2020)"),
    "grpo": LossSpec(_grpo, {**_CLIP_HIGHER, "kl_coef": 0.0}, "group_zscore",
                     "GRPO (DeepSeekMath 2024), clip-higher"),
    "dr_grpo": LossSpec(_dr_grpo, {**_CLIP, "constant": None}, "group_mean",
                        "Dr. GRPO (Liu 2025)"),
    "dapo": LossSpec(_dapo, _CLIP_HIGHER, "group_zscore",
                     "DAPO (Yu 2025) token-level loss"),
    "gspo": LossSpec(_gspo, {"eps_low": 3e-4, "eps_high": 4e-4},
                     "group_zscore", "GSPO (Zheng 2025) sequence ratio"),
    "cispo": LossSpec(_cispo, {"eps_low": 1.0, "eps_high": 0.28},
                      "group_zscore", "CISPO (MiniMax-M1 2025)"),
    "areal": LossSpec(_areal, {**_CLIP, "behav_weight_cap": None}, "gae",
                      "AReaL decoupled PPO (Fu 2025)"),
    "tis": LossSpec(_tis, {**_CLIP, "cap": 2.0}, "group_zscore",
                    "PPO + truncated IS mismatch factor (Yao 2025)"),
    "icepop": LossSpec(_icepop, {**_CLIP_HIGHER, "mismatch_low": 0.5,
                                 "mismatch_high": 5.0}, "group_zscore",
                       "PPO + IcePop masked mismatch factor (Ling 2025)"),
    "vapo": LossSpec(_dapo, _CLIP_HIGHER, "vapo_gae",
                     "VAPO (Yue 2025): clip-higher token-mean PPO, "
                     "length-adaptive GAE alpha=0.05"),
    "reinforce_pp": LossSpec(_ppo, {**_CLIP, "kl_coef": 0.0}, "batch_whiten",
                             "REINFORCE++ (Hu 2025): PPO clip on "
                             "batch-whitened advantages"),
}


def known_losses() -> tuple[str, ...]:
  """Registered algorithm names, sorted."""
  return tuple(sorted(_REGISTRY))


def get_spec(name: str) -> LossSpec:
  """The ``LossSpec`` registered under ``name``; raises listing known names."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(
        f"Unknown loss {name!r}; known losses: {', '.join(known_losses())}."
    ) from None


def resolve_hparams(name: str, config: Optional[Any] = None) -> dict[str, Any]:
  """Algorithm defaults overridden by matching, non-None keys of ``config``.

  ``config`` may be a dict, an ``ml_collections.ConfigDict`` or None; keys the
  algorithm does not use are ignored.
  """
  hp = dict(get_spec(name).defaults)
  if config is not None:
    for key in hp:
      if key in config and config[key] is not None:
        hp[key] = config[key]
  return hp


def get_loss_fn(name: str, config: Optional[Any] = None) -> LossFn:
  """Returns ``fn(logp, batch) -> (loss, metrics)`` with hparams bound."""
  spec = get_spec(name)
  hp = resolve_hparams(name, config)

  def loss_fn(logp: Array, batch: PolicyBatch):
    return spec.fn(logp, batch, **hp)

  loss_fn.__name__ = f"{name}_loss"
  loss_fn.__doc__ = spec.description
  return loss_fn


def policy_loss(name: str, logp: Array, batch: PolicyBatch,
                config: Optional[Any] = None):
  """One-shot ``get_loss_fn(name, config)(logp, batch)``."""
  return get_loss_fn(name, config)(logp, batch)
