"""The advantage estimators other than the critic's, and reward shaping.

SAO's own estimators, skip-observation and decoupled GAE over the critic's
values, are part of its objective (``sao_jax.rl.losses``, docs/design/math.md);
here are those of the ablations and baselines (docs/design/math.md
"Interfaces"), jit-able: group baselines (GRPO's z-score, Dr. GRPO's mean,
RLOO), REINFORCE++ batch whitening of the reward-to-go, the per-prompt running
mean, and DAPO's dynamic sampling and overlong penalty.

Token-level estimators take ``[B, T]`` arrays with ``mask`` = 1 on action tokens
(the policy produced them) and 0 on prompt, padding and environment
observations; they return 0 on non-action tokens. Trajectory-level estimators
(group baselines, running mean) take one scalar reward per trajectory, ``[N]``;
spread them over tokens with ``broadcast_to_tokens``.

Every estimator a config may pick (``config.rl.advantage``, ``LossSpec.
advantage``), the critic's included, is an ``Estimator`` in the table at the
end (``register_advantage`` adds one; ``available_advantages`` lists them).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import flax.struct
import jax
import jax.numpy as jnp

from sao_jax import registry as registry_lib
from sao_jax.rl import losses
from sao_jax.rl import metrics as rl_metrics
from sao_jax.rl import segments

Array = jax.Array


# ----------------------------------------------------------------------------
# Per-token helpers.
# ----------------------------------------------------------------------------


def reward_to_go(rewards: Array, mask: Array, *,
                 gamma: losses.Scalar = 1.0,
                 segment_ids: Optional[Array] = None) -> Array:
  """Discounted reward-to-go over action tokens (``losses.gae`` with V=0,
  λ=1; per trajectory of packed rows with ``segment_ids``)."""
  _, returns = losses.gae(rewards, jnp.zeros_like(rewards), mask, gamma=gamma,
                          lam=1.0, segment_ids=segment_ids)
  return returns


def broadcast_to_tokens(seq_values: Array, mask: Array) -> Array:
  """Spreads per-trajectory scalars [B] over their action tokens -> [B, T]."""
  m = rl_metrics.as_mask(mask)
  return jnp.where(m > 0, jnp.asarray(seq_values, jnp.float32)[:, None], 0.0)


# ----------------------------------------------------------------------------
# Group and batch baselines.
# ----------------------------------------------------------------------------


def _groups(rewards: Array, group_ids: Optional[Array],
            num_groups: Optional[int]):
  """Flat rewards [N], ids [N], G and a function restoring the input shape."""
  rewards = jnp.asarray(rewards, jnp.float32)
  shape = rewards.shape
  if group_ids is None:
    if rewards.ndim != 2:
      raise ValueError(
          f"Without group_ids, rewards must be [num_groups, group_size]; got "
          f"shape {shape}. Pass group_ids (int [N]) and num_groups instead.")
    g, n = shape
    ids = jnp.repeat(jnp.arange(g, dtype=jnp.int32), n)
    return rewards.reshape(-1), ids, g, lambda x: x.reshape(shape)
  if num_groups is None:
    raise ValueError("group_ids needs num_groups (a static int, > max id) so "
                     "segment sums have a fixed size under jit.")
  ids = jnp.asarray(group_ids, jnp.int32).reshape(-1)
  return rewards.reshape(-1), ids, num_groups, lambda x: x.reshape(shape)


def _seg_sum(x, ids, g):
  return jax.ops.segment_sum(x, ids, num_segments=g)


def _group_mean_count(r, ids, g):
  cnt = _seg_sum(jnp.ones_like(r), ids, g)
  mean = _seg_sum(r, ids, g) / jnp.maximum(cnt, 1.0)
  return mean, cnt


def group_zscore(rewards: Array, group_ids: Optional[Array] = None,
                 num_groups: Optional[int] = None, *, eps: float = 1e-6,
                 ddof: int = 1) -> Array:
  """GRPO outcome advantage (DeepSeekMath 2024, §4.1.2): (r−mean_g)/(std_g+ε).

  Statistics per group of rollouts of one prompt. ``ddof=1`` (sample std, as TRL
  and verl compute it); a singleton group or a group with equal rewards gets 0.

  Args:
    rewards: [G, n] (each row a group) or [N] with ``group_ids``.
    group_ids: optional int [N] group index per trajectory (ragged groups).
    num_groups: number of groups (static) when ``group_ids`` is given.
    eps: added to the std.
    ddof: delta degrees of freedom of the std.

  Returns:
    Advantages, same shape as ``rewards``.
  """
  r, ids, g, restore = _groups(rewards, group_ids, num_groups)
  mean, cnt = _group_mean_count(r, ids, g)
  centred = r - mean[ids]
  var = _seg_sum(jnp.square(centred), ids, g) / jnp.maximum(cnt - ddof, 1.0)
  std = jnp.sqrt(var)
  return restore(centred / (std[ids] + eps))


def group_mean(rewards: Array, group_ids: Optional[Array] = None,
               num_groups: Optional[int] = None) -> Array:
  """Dr. GRPO advantage (Liu 2025): r − mean_g, no std normalisation."""
  r, ids, g, restore = _groups(rewards, group_ids, num_groups)
  mean, _ = _group_mean_count(r, ids, g)
  return restore(r - mean[ids])


def rloo(rewards: Array, group_ids: Optional[Array] = None,
         num_groups: Optional[int] = None) -> Array:
  """REINFORCE leave-one-out (Kool 2019; Ahmadian 2024): r_i − mean_{j≠i} r_j.

  A singleton group has no other rollout and gets 0.
  """
  r, ids, g, restore = _groups(rewards, group_ids, num_groups)
  total = _seg_sum(r, ids, g)
  cnt = _seg_sum(jnp.ones_like(r), ids, g)
  others = cnt[ids] - 1.0
  loo_mean = (total[ids] - r) / jnp.maximum(others, 1.0)
  return restore(jnp.where(others > 0, r - loo_mean, 0.0))


def batch_whiten(advantages: Array, mask: Array, *, eps: float = 1e-8) -> Array:
  """REINFORCE++ (Hu 2025) global normalisation: whiten over all action tokens.

  (A − mean)/(std + ε) with mean/std over every mask==1 token of the batch
  (population std); 0 on non-action tokens. Works with one rollout per prompt.
  """
  return rl_metrics.masked_whiten(jnp.asarray(advantages, jnp.float32), mask,
                                  eps=eps)


def reinforce_pp_advantages(rewards: Array, mask: Array, *,
                            gamma: losses.Scalar = 1.0,
                            eps: float = 1e-8,
                            segment_ids: Optional[Array] = None) -> Array:
  """REINFORCE++ (Hu 2025): batch-whitened reward-to-go over action tokens.

  Any per-token KL penalty is expected to be already folded into ``rewards``.
  """
  return batch_whiten(reward_to_go(rewards, mask, gamma=gamma,
                                   segment_ids=segment_ids), mask, eps=eps)


# ----------------------------------------------------------------------------
# Running-mean baseline (per prompt).
# ----------------------------------------------------------------------------


@flax.struct.dataclass
class RunningMeanState:
  """Last k rewards of each prompt (SAO §4 baseline: paper k=8; online k=128).

  Attributes:
    buffer: [num_prompts, k] ring of rewards; slot ``count % k`` is written
      next.
    count: [num_prompts] int32 number of rewards ever recorded per prompt.
  """

  buffer: Array
  count: Array


def running_mean_init(num_prompts: int, k: int = 8) -> RunningMeanState:
  """Empty state for ``num_prompts`` prompt ids in [0, num_prompts)."""
  if k < 1:
    raise ValueError(f"k must be >= 1 (got {k}).")
  return RunningMeanState(buffer=jnp.zeros((num_prompts, k), jnp.float32),
                          count=jnp.zeros((num_prompts,), jnp.int32))


def running_mean_update(state: RunningMeanState, prompt_ids: Array,
                        rewards: Array,
                        valid: Optional[Array] = None) -> RunningMeanState:
  """Records rewards [N] of prompts [N] in order (repeated ids in one batch OK).

  Ids must lie in [0, num_prompts): out-of-range ids are dropped (jnp scatter).
  ``valid`` (bool [N]) skips the entries that hold no trajectory (the empty
  slots of packed rows).
  """
  k = state.buffer.shape[1]

  def step(st, xs):
    pid, r, ok = xs
    slot = st.count[pid] % k
    new = RunningMeanState(buffer=st.buffer.at[pid, slot].set(r),
                           count=st.count.at[pid].add(1))
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, st), None

  ids = jnp.asarray(prompt_ids, jnp.int32).reshape(-1)
  rs = jnp.asarray(rewards, jnp.float32).reshape(-1)
  ok = (jnp.ones(ids.shape, bool) if valid is None
        else jnp.asarray(valid, bool).reshape(-1))
  state, _ = jax.lax.scan(step, state, (ids, rs, ok))
  return state


def running_mean_baseline(state: RunningMeanState, prompt_ids: Array, *,
                          default: float = 0.0) -> Array:
  """Mean of the last min(count, k) rewards per prompt; ``default`` if none."""
  ids = jnp.asarray(prompt_ids, jnp.int32)
  k = state.buffer.shape[1]
  n = jnp.minimum(state.count[ids], k).reshape(-1)
  valid = jnp.arange(k)[None, :] < n[:, None]
  rows = state.buffer[ids.reshape(-1)]
  total = jnp.sum(jnp.where(valid, rows, 0.0), axis=-1)
  mean = total / jnp.maximum(n, 1)
  return jnp.where(n > 0, mean, default).reshape(ids.shape)


def running_mean_advantages(state: RunningMeanState, prompt_ids: Array,
                            rewards: Array, *, default: float = 0.0,
                            valid: Optional[Array] = None
                            ) -> tuple[Array, RunningMeanState]:
  """r − baseline(prompt), then records r (baseline excludes this batch).

  The running-mean baseline of SAO's ablations (mean of the last k rewards of
  the prompt). Returns (advantages [N], new_state).
  """
  base = running_mean_baseline(state, prompt_ids, default=default)
  adv = jnp.asarray(rewards, jnp.float32) - base
  return adv, running_mean_update(state, prompt_ids, rewards, valid)


# ----------------------------------------------------------------------------
# DAPO: dynamic sampling and overlong shaping.
# ----------------------------------------------------------------------------


def dynamic_sampling_keep(rewards: Array, group_ids: Optional[Array] = None,
                          num_groups: Optional[int] = None) -> Array:
  """DAPO dynamic sampling (Yu 2025, §3.2): keep groups whose rewards differ.

  A group whose rewards are all equal (all correct / all wrong, or a singleton)
  has zero group-normalised advantage and is dropped. Returns a bool keep mask
  shaped like ``rewards``.
  """
  r, ids, g, restore = _groups(rewards, group_ids, num_groups)
  hi = jax.ops.segment_max(r, ids, num_segments=g)
  lo = jax.ops.segment_min(r, ids, num_segments=g)
  return restore((hi > lo)[ids])


def overlong_penalty(lengths: Array, *, max_len: int, cache_len: int) -> Array:
  """DAPO soft overlong punishment (Yu 2025, §3.4), added to the reward.

  0 if |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|)/L_cache inside the last
  ``cache_len`` tokens (linear from 0 to −1); −1 if |y| > L_max.
  """
  if not 0 < cache_len <= max_len:
    raise ValueError("need 0 < cache_len <= max_len; got "
                     f"cache_len={cache_len}, max_len={max_len}.")
  length = jnp.asarray(lengths, jnp.float32)
  start = float(max_len - cache_len)
  soft = (start - length) / float(cache_len)
  return jnp.where(length <= start, 0.0,
                   jnp.where(length <= max_len, soft, -1.0))


# ----------------------------------------------------------------------------
# The estimators a config may name: one table, one signature.
# ----------------------------------------------------------------------------


def trajectory_rewards(batch: Mapping[str, Array], rewards: Array
                       ) -> tuple[Array, Array | None, Callable[[Array], Array]]:
  """Per-trajectory returns ``[N]``, which entries hold a trajectory (None:
  all) and the map spreading ``[N]`` values over their tokens ``[B, T]``:
  N = B rows, or B·S slots of packed rows (an empty slot has ``length`` 0)."""
  if "segment_ids" not in batch:
    return rewards.sum(-1), None, lambda x: x[:, None]
  seg = batch["segment_ids"]
  shape = batch["length"].shape
  per = segments.segment_sum(rewards, seg, shape[1]).reshape(-1)
  return per, (batch["length"] > 0).reshape(-1), (
      lambda x: segments.to_tokens(x.reshape(shape), seg))


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """A batch as every estimator reads it; a packed row's trajectories (with
  ``segment_ids``) are rows of their own to each.

  Attributes:
    batch: The batch itself (``group_index``, ``prompt_id``, ... by name).
    rewards: [B, T] float32 rewards on action tokens, 0 elsewhere.
    mask: [B, T] float32, 1 on action tokens.
    values: [B, T] the critic's V before each token (0 without a critic).
    segment_ids: The packed rows' segment ids; None: one trajectory a row.
    num_slots: Trajectories a row holds at most (1 unpacked).
    seq_reward: [N] each trajectory's summed reward.
    valid: [N] bool, which entries hold a trajectory; None: all.
    spread: Spreads [N] per-trajectory values over their tokens, [B, T].
  """

  batch: Mapping[str, Array]
  rewards: Array
  mask: Array
  values: Array
  segment_ids: Array | None
  num_slots: int
  seq_reward: Array
  valid: Array | None
  spread: Callable[[Array], Array]

  @classmethod
  def of(cls, batch: Mapping[str, Array], values: Array) -> "Rollouts":
    mask = batch["action_mask"].astype(jnp.float32)
    rewards = batch["rewards"].astype(jnp.float32) * mask
    seg = batch.get("segment_ids")
    slots = batch["length"].shape[1] if seg is not None else 1
    return cls(batch, rewards, mask, values, seg, slots,
               *trajectory_rewards(batch, rewards))

  def on_actions(self, seq_values: Array) -> Array:
    """Per-trajectory values [N] on their action tokens, 0 elsewhere."""
    return jnp.where(self.mask > 0, self.spread(seq_values), 0.0)


# The step's settings (``train.step.StepConfig``: ``gamma``, ``lam_critic``,
# ``lam_policy_alpha``, ``max_groups``), as estimators read them.
Settings = Any
# fn(settings, rollouts, state) -> (advantages [B, T], new state).
EstimatorFn = Callable[[Settings, Rollouts, Any], tuple[Array, Any]]


@dataclasses.dataclass(frozen=True)
class Estimator:
  """A registered advantage estimator.

  Attributes:
    fn: ``fn(settings, rollouts, state) -> (advantages, new_state)``,
      advantages [B, T] and 0 off action tokens; ``state`` is
      ``TrainState.running_mean`` (None unless a run keeps one), passed
      through by an estimator that keeps none.
    description: One line for listings.
    uses_critic: Whether it reads ``Rollouts.values`` (the step evaluates and
      trains the critic only then).
  """

  fn: EstimatorFn
  description: str
  uses_critic: bool = False


def critic_gae(cfg: Settings, x: Rollouts) -> tuple[Array, Array]:
  """GAE with λ_critic: (advantages, returns), the returns being the value
  targets of every estimator (``losses.gae``)."""
  return losses.gae(x.rewards, x.values, x.mask, gamma=cfg.gamma,
                    lam=cfg.lam_critic, segment_ids=x.segment_ids)


def _decoupled(alpha: Callable[[Settings], float]) -> EstimatorFn:
  def fn(cfg, x, state):
    adv, _ = losses.decoupled_gae(
        x.rewards, x.values, x.mask, gamma=cfg.gamma, alpha=alpha(cfg),
        lam_critic=cfg.lam_critic, segment_ids=x.segment_ids,
        num_slots=x.num_slots)
    return adv, state
  return fn


def _per_group(group_fn: Callable[[Array, Array, int], Array]) -> EstimatorFn:
  def fn(cfg, x, state):
    group = x.batch["group_index"].reshape(-1)
    if x.valid is not None:  # Empty slots join no group (index out of range).
      group = jnp.where(x.valid, group, cfg.max_groups)
    return x.on_actions(group_fn(x.seq_reward, group, cfg.max_groups)), state
  return fn


def _batch_whiten(cfg: Settings, x: Rollouts, state: Any):
  return reinforce_pp_advantages(x.rewards, x.mask, gamma=cfg.gamma,
                                 segment_ids=x.segment_ids), state


def _running_mean(cfg: Settings, x: Rollouts, state: Any):
  del cfg  # k and the table's rows are the state's.
  if state is None:
    raise ValueError("advantage='running_mean' needs TrainState.running_mean "
                     "(adv_lib.running_mean_init(num_prompts, k)).")
  # One table row per prompt: n consecutive prompt ids (a task set's item
  # seeds) fall on n distinct rows; one row pools every prompt ('global').
  ids = x.batch["prompt_id"].reshape(-1) % state.count.shape[0]
  seq_adv, state = running_mean_advantages(state, ids, x.seq_reward,
                                           valid=x.valid)
  return x.on_actions(seq_adv), state


# The built-in estimators (``available_advantages`` adds those registered).
ESTIMATORS: dict[str, Estimator] = {
    "decoupled_gae": Estimator(
        _decoupled(lambda cfg: cfg.lam_policy_alpha),
        "SAO: λ_policy = 1 − 1/(α·l) for advantages, λ_critic for targets",
        uses_critic=True),
    "gae": Estimator(lambda cfg, x, state: (critic_gae(cfg, x)[0], state),
                     "GAE with λ_critic (Schulman 2016)", uses_critic=True),
    "vapo_gae": Estimator(_decoupled(lambda cfg: losses.VAPO_ALPHA),
                          "VAPO: decoupled GAE with α = 0.05",
                          uses_critic=True),
    "group_zscore": Estimator(_per_group(group_zscore),
                              "GRPO: (r − mean_g) / (std_g + ε)"),
    "group_mean": Estimator(_per_group(group_mean), "Dr. GRPO: r − mean_g"),
    "rloo": Estimator(_per_group(rloo), "RLOO: r − leave-one-out mean_g"),
    "batch_whiten": Estimator(_batch_whiten,
                              "REINFORCE++: batch-whitened reward-to-go"),
    "running_mean": Estimator(_running_mean,
                              "r − mean of the prompt's last k rewards"),
}
_ESTIMATORS = registry_lib.Registry[Estimator](
    "advantage estimator", ESTIMATORS,
    how="register_advantage (docs/design/extending.md)")


def register_advantage(name: str, estimator: Estimator) -> None:
  """Adds ``estimator`` under ``name``; refuses to silently replace one."""
  _ESTIMATORS.register(name, estimator)


def available_advantages() -> tuple[str, ...]:
  """Registered estimator names, sorted."""
  return _ESTIMATORS.names()


def get_advantage(name: str) -> Estimator:
  """The ``Estimator`` registered under ``name``; raises listing known names."""
  return _ESTIMATORS.get(name)
