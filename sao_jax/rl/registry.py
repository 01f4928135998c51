"""Config name -> policy loss, with one call signature for every algorithm.

``config.rl.loss`` picks the algorithm (docs/design/math.md "Baselines for
ablations"). The train step resolves it once, when it is built, and calls it
on each batch (inside the jitted step) as tests and tools do::

  loss_fn = registry.get_loss_fn(config.rl.loss, config.rl)
  loss, metrics = loss_fn(logp, registry.PolicyBatch(rollout_logp=..., ...))

Each entry is a ``LossSpec``: a function of ``sao_jax.rl.losses`` (SAO's
DIS) or ``sao_jax.rl.baselines`` (the methods it is compared with), the
``PolicyBatch`` fields it reads, the settings that make the algorithm (e.g.
GRPO is ``ppo_clip_loss`` with clip-higher and a per-sequence token mean), the
tunable hyper-parameters and the advantage estimator it pairs with. A
tunable's default is the loss function's own keyword default unless the entry
overrides it, so each default is written once. Config keys a loss does not use
are ignored, and ``None`` keeps the default.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping, Optional

import flax.struct
import jax

from sao_jax import registry as registry_lib
from sao_jax.rl import advantages
from sao_jax.rl import baselines
from sao_jax.rl import losses

Array = jax.Array
LossFn = Callable[..., tuple[Array, dict[str, Array]]]


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


def read_input(batch: PolicyBatch, name: str) -> Array:
  """``batch.<name>``, where π_old falls back to π_rollout and π_prox to π_old.

  The train step always sets π_old and π_prox (one update per batch); the
  fallbacks serve callers that pass only the rollout log-probs.
  """
  value = getattr(batch, name)
  if value is not None:
    return value
  if name == "old_logp":
    return batch.rollout_logp
  if name == "prox_logp" and batch.old_logp is not None:
    return batch.old_logp
  raise ValueError(
      f"The loss needs PolicyBatch.{name}: set it (for 'areal', log π_prox "
      "recomputed by the trainer before the update; prox_logp or old_logp).")


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered algorithm.

  Attributes:
    fn: The loss, ``fn(logp, *inputs, advantages, mask, **kwargs)``.
    inputs: Per positional argument between ``logp`` and ``advantages``, the
      ``PolicyBatch`` field it is (``read_input``).
    advantage: The advantage estimator it pairs with (one of
      ``advantages.available_advantages()``).
    description: One line for listings.
    hparams: The tunable keyword arguments.
    overrides: Defaults of tunables that differ from ``fn``'s own.
    fixed: Keyword arguments that make the algorithm (not tunable).
    batch_kwargs: Optional ``PolicyBatch`` fields passed by keyword.
  """

  fn: LossFn
  inputs: tuple[str, ...]
  advantage: str
  description: str
  hparams: tuple[str, ...] = ("eps_low", "eps_high")
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  batch_kwargs: tuple[str, ...] = ()

  @property
  def defaults(self) -> dict[str, Any]:
    """Each tunable's default: the override, else ``fn``'s keyword default."""
    params = inspect.signature(self.fn).parameters
    return {k: self.overrides.get(k, params[k].default) for k in self.hparams}

  def bind(self, **hparams) -> LossFn:
    """The array-level loss with this algorithm's settings and defaults."""
    return functools.partial(self.fn, **self.fixed,
                             **{**self.defaults, **hparams})

  def __call__(self, logp: Array, batch: PolicyBatch, **hparams):
    """The loss of ``logp`` on ``batch`` (tunables not given: defaults)."""
    kwargs = {k: getattr(batch, k) for k in self.batch_kwargs}
    return self.bind(**hparams)(
        logp, *(read_input(batch, name) for name in self.inputs),
        batch.advantages, batch.mask, **kwargs)


_DIS = functools.partial(LossSpec, losses.dis_policy_loss, ("rollout_logp",))
_PPO = functools.partial(LossSpec, baselines.ppo_clip_loss, ("old_logp",))
_CLIP_HIGHER = {"eps_high": 0.28}  # DAPO's ε_h (ε_l stays 0.2).
_KL = {"hparams": ("eps_low", "eps_high", "kl_coef"),
       "batch_kwargs": ("ref_logp",)}

_BUILT_IN: dict[str, LossSpec] = {
    "sao": _DIS("decoupled_gae",
                "SAO: DIS (Eqs. 1-3) + critic with decoupled GAE"),
    "dis": _DIS("decoupled_gae", "alias of 'sao'"),
    "grpo_dis": _DIS("group_zscore",
                     "DIS loss with GRPO group z-score advantages"),
    "ppo": _PPO("gae", "PPO clip (Schulman 2017)", **_KL),
    "dual_clip_ppo": _PPO(
        "gae", "dual-clip PPO (Ye 2020): max(·, c·A) for A<0, c=3",
        hparams=("eps_low", "eps_high", "dual_clip"),
        overrides={"dual_clip": 3.0}),
    "grpo": _PPO("group_zscore",
                 "GRPO (DeepSeekMath 2024, Eq. 3), clip-higher, per-sequence "
                 "token mean, optional β·k3 KL",
                 overrides=_CLIP_HIGHER,
                 fixed={"aggregation": "seq_mean_token_mean"}, **_KL),
    "dr_grpo": _PPO("group_mean",
                    "Dr. GRPO (Liu 2025): no length normalisation, Σ/(B·C)",
                    hparams=("eps_low", "eps_high", "constant"),
                    fixed={"aggregation": "token_sum_norm"}),
    "dapo": _PPO("group_zscore",
                 "DAPO (Yu 2025): clip-higher (§3.1), token-level mean (§3.3)",
                 overrides=_CLIP_HIGHER),
    "gspo": LossSpec(baselines.gspo_loss, ("old_logp",), "group_zscore",
                     "GSPO (Zheng 2025) sequence ratio"),
    "cispo": LossSpec(baselines.cispo_loss, ("old_logp",), "group_zscore",
                      "CISPO (MiniMax-M1 2025)"),
    "areal": LossSpec(baselines.areal_loss, ("prox_logp", "rollout_logp"), "gae",
                      "AReaL decoupled PPO (Fu 2025)",
                      hparams=("eps_low", "eps_high", "behav_weight_cap")),
    "tis": LossSpec(baselines.tis_loss, ("rollout_logp",), "group_zscore",
                    "PPO + truncated IS mismatch factor (Yao 2025)",
                    hparams=("eps_low", "eps_high", "cap"),
                    batch_kwargs=("old_logp",)),
    "icepop": LossSpec(baselines.icepop_loss, ("rollout_logp",), "group_zscore",
                       "PPO + IcePop masked mismatch factor (Ling 2025)",
                       hparams=("eps_low", "eps_high", "mismatch_low",
                                "mismatch_high"),
                       batch_kwargs=("old_logp",)),
    "vapo": _PPO("vapo_gae",
                 "VAPO (Yue 2025): clip-higher token-mean PPO, "
                 "length-adaptive GAE alpha=0.05", overrides=_CLIP_HIGHER),
    "reinforce_pp": _PPO("batch_whiten",
                         "REINFORCE++ (Hu 2025): PPO clip on batch-whitened "
                         "advantages", **_KL),
}
_REGISTRY = registry_lib.Registry[LossSpec](
    "loss", {}, plural="losses",
    how="register_loss (docs/design/extending.md)")


def register_loss(name: str, spec: LossSpec) -> None:
  """Adds ``spec`` under ``name``; refuses to silently replace one, or one
  whose advantage estimator is not registered."""
  if spec.advantage not in advantages.available_advantages():
    raise ValueError(f"Loss {name!r}: unknown advantage estimator "
                     f"{spec.advantage!r}.")
  _REGISTRY.register(name, spec)


for _name, _spec in _BUILT_IN.items():
  register_loss(_name, _spec)


def known_losses() -> tuple[str, ...]:
  """Registered algorithm names, sorted."""
  return _REGISTRY.names()


def get_spec(name: str) -> LossSpec:
  """The ``LossSpec`` registered under ``name``; raises listing known names."""
  return _REGISTRY.get(name)


def resolve_hparams(name: str, config: Optional[Any] = None) -> dict[str, Any]:
  """Algorithm defaults overridden by matching, non-None keys of ``config``.

  ``config`` may be a dict, an ``ml_collections.ConfigDict`` or None; keys the
  algorithm does not use are ignored.
  """
  hp = get_spec(name).defaults
  if config is not None:
    for key in hp:
      if key in config and config[key] is not None:
        hp[key] = config[key]
  return hp


def get_loss_fn(name: str, config: Optional[Any] = None) -> LossFn:
  """Returns ``fn(logp, batch) -> (loss, metrics)`` with hparams bound."""
  return functools.partial(get_spec(name), **resolve_hparams(name, config))
