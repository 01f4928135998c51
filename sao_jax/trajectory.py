"""The trajectory record: the one schema shared by sampler, ring, stream and trainer.

DESIGN.md §3: prompt id, token ids ``int32[T]``, action mask ``uint8[T]``, rollout
log-probs ``float32[T]``, per-token policy version ``int32[T]``, reward (per token or
terminal), env/task name, finish reason (stop, length, turns, error).

Tokens are the whole sequence the policy saw: prompt, actions and environment
observations. ``action_mask`` is 1 exactly on tokens the policy sampled; only there are
``rollout_logp`` and ``policy_version`` meaningful (0 and -1 elsewhere).
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class FinishReason(enum.IntEnum):
  """Why an episode ended."""

  STOP = 0  # The policy emitted a stop token / final answer.
  LENGTH = 1  # Token budget exhausted.
  TURNS = 2  # Turn budget exhausted.
  ERROR = 3  # The environment raised; ``error`` holds the message.


NO_VERSION = -1  # policy_version of tokens the policy did not sample.


@dataclasses.dataclass
class Trajectory:
  """One episode: a single rollout for one prompt (SAO uses n_rollouts=1).

  Attributes:
    prompt_id: Stable id of the task/prompt (for running-mean baselines, grouping).
    tokens: int32[T] every token of the episode, in order.
    action_mask: uint8[T] 1 on policy-sampled tokens, 0 on prompt/observations.
    rollout_logp: float32[T] log π_rollout of each sampled token (0 elsewhere).
    policy_version: int32[T] version of the policy that sampled each token
      (NO_VERSION on non-action tokens).
    rewards: float32[T] per-token rewards; a terminal reward sits on the last
      action token.
    task: Environment/task name.
    finish_reason: A FinishReason.
    group_id: Group index for group-sampling baselines (GRPO); -1 for SAO.
    error: Error message when finish_reason is ERROR, else "".
  """

  prompt_id: int
  tokens: np.ndarray
  action_mask: np.ndarray
  rollout_logp: np.ndarray
  policy_version: np.ndarray
  rewards: np.ndarray
  task: str = ""
  finish_reason: FinishReason = FinishReason.STOP
  group_id: int = -1
  error: str = ""

  def __post_init__(self):
    self.tokens = np.asarray(self.tokens, dtype=np.int32)
    self.action_mask = np.asarray(self.action_mask, dtype=np.uint8)
    self.rollout_logp = np.asarray(self.rollout_logp, dtype=np.float32)
    self.policy_version = np.asarray(self.policy_version, dtype=np.int32)
    self.rewards = np.asarray(self.rewards, dtype=np.float32)
    self.finish_reason = FinishReason(self.finish_reason)
    n = self.tokens.shape
    for name in ("action_mask", "rollout_logp", "policy_version", "rewards"):
      arr = getattr(self, name)
      if arr.ndim != 1 or arr.shape != n:
        raise ValueError(
            f"Trajectory.{name} has shape {arr.shape}; expected {n} to match "
            "tokens (every per-token field must be 1-D and the same length)."
        )

  @property
  def length(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def num_action_tokens(self) -> int:
    return int(self.action_mask.sum())

  @property
  def total_reward(self) -> float:
    return float(self.rewards.sum())

  def oldest_version(self) -> int:
    """Oldest policy version among action tokens (DESIGN §4); NO_VERSION if none."""
    v = self.policy_version[self.action_mask.astype(bool)]
    return int(v.min()) if v.size else NO_VERSION

  def staleness(self, trainer_version: int) -> int:
    """trainer version − oldest token version (DESIGN §4); 0 with no actions."""
    oldest = self.oldest_version()
    return 0 if oldest == NO_VERSION else trainer_version - oldest
