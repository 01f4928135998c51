"""The trajectory record: its schema, its bytes, the batch it becomes.

The one place the record is defined, shared by sampler, ring, stream and
trainer (docs/design/data_path.md "Trajectory record and batch"):

- ``Trajectory``: prompt id, token ids ``int32[T]``, action mask ``uint8[T]``,
  rollout log-probs ``float32[T]``, per-token policy version ``int32[T]``,
  per-token rewards, task name, finish reason (stop, length, turns, error);
  ``EpisodeRecord``, the episode as the sampler builds it, and the one place
  a ``Trajectory`` is made from one.
- ``encode`` / ``decode``: the record as bytes for the ring (no pickle).
- ``TOKEN_FIELDS`` / ``ROW_FIELDS`` / ``pad_row`` / ``with_group_index``: the
  ``[B, T]`` batch schema the stream fills.
- ``StalenessPolicy``: the staleness bound both ends apply
  (docs/design/data_path.md "Staleness").

Tokens are the whole sequence the policy saw: prompt, actions and environment
observations. ``action_mask`` is 1 exactly on tokens the policy sampled; only
there are ``rollout_logp`` and ``policy_version`` meaningful (0 and -1
elsewhere).
"""

from __future__ import annotations

import dataclasses
import enum
import struct

import numpy as np

from sao_jax.envs.base import Environment


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
    routed_experts: uint16[T, M, k], for a mixture-of-experts policy: the k
      experts the sampler routed each token to in each of its M MoE layers
      (prompt, actions and observations), replayed by the trainer's forward
      with `model.routing_replay='rollout'` (R3); None for a dense policy.
    episode: The consumer's episode number (``ConsumedEpisodes.add``); not
      part of the record's bytes, -1 until counted.
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
  routed_experts: np.ndarray | None = None
  episode: int = dataclasses.field(default=-1, compare=False)

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
    if self.routed_experts is not None:
      self.routed_experts = np.asarray(self.routed_experts, dtype=np.uint16)
      if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != n[0]:
        raise ValueError(
            f"Trajectory.routed_experts has shape {self.routed_experts.shape};"
            f" expected ({n[0]}, moe_layers, top_k).")

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
    """Oldest policy version among action tokens; NO_VERSION if none.

    See docs/design/data_path.md "Staleness".
    """
    v = self.policy_version[self.action_mask.astype(bool)]
    return int(v.min()) if v.size else NO_VERSION

  def staleness(self, trainer_version: int) -> int:
    """trainer version − oldest token version; 0 with no actions.

    See docs/design/data_path.md "Staleness".
    """
    oldest = self.oldest_version()
    return 0 if oldest == NO_VERSION else trainer_version - oldest


@dataclasses.dataclass
class EpisodeRecord:
  """One episode's tokens so far and how it ended, as the sampler builds it.

  Every rollout engine (``sampler/rollout.py`` `Episode`) appends each
  prompt, action and observation with ``add``; ``trajectory`` is the one place
  a `Trajectory` is made from an episode.
  """

  tokens: list[int] = dataclasses.field(default_factory=list)
  mask: list[int] = dataclasses.field(default_factory=list)
  logp: list[float] = dataclasses.field(default_factory=list)
  version: list[int] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  finish: FinishReason | None = None
  error: str = ""
  experts: list[np.ndarray] = dataclasses.field(default_factory=list)

  def add(self, toks, mask: int, logp=None, version: int = NO_VERSION,
          experts: np.ndarray | None = None) -> None:
    """Appends ``toks`` with one action-mask value (1: sampled by the policy
    ``version``, with log-probs ``logp``; 0: prompt or observation) and, for
    a MoE policy, the experts they were routed to (``[len(toks), M, k]``)."""
    n = len(toks)
    if experts is not None:
      self.experts.append(np.asarray(experts, np.uint16).reshape(
          n, *np.shape(experts)[-2:]))
    self.tokens += [int(t) for t in toks]
    self.mask += [mask] * n
    self.logp += [0.0] * n if logp is None else [float(x) for x in logp]
    self.version += [version] * n
    self.rewards += [0.0] * n

  def trajectory(self, env: Environment) -> Trajectory:
    """The record of this episode of ``env`` (its prompt id and task name);
    an episode that never finished ends as TURNS."""
    return Trajectory(
        prompt_id=env.prompt_id, tokens=self.tokens, action_mask=self.mask,
        rollout_logp=self.logp, policy_version=self.version,
        rewards=self.rewards, task=env.name,
        finish_reason=(FinishReason.TURNS if self.finish is None
                       else self.finish),
        error=self.error,
        routed_experts=(np.concatenate(self.experts) if self.experts
                        else None))


# ------------------------------------------------------------ the bytes ---
#
# Trajectory <-> bytes without pickle: a small header plus raw array bytes.
# Layout (little-endian)::
#
#     header  <4sHHIqqIIHH : magic b"SAOT", codec version, finish_reason,
#                          T, prompt_id, group_id, len(task), len(error),
#                          M, k (MoE layers and experts per token; 0, 0 dense)
#     tokens          int32[T]
#     rollout_logp    float32[T]
#     policy_version  int32[T]
#     rewards         float32[T]
#     routed_experts  uint16[T, M, k]
#     action_mask     uint8[T]
#     task, error     utf-8
#
# The arrays follow the 40-byte header, widest first, so every array starts
# aligned and ``decode`` returns NumPy views into the given buffer (no copy).
# Version 1 (no M, k: dense records written before MoE) still decodes.

_MAGIC = b"SAOT"
_VERSION = 2
_HEADER = struct.Struct("<4sHHIqqIIHH")
_HEADER_V1 = struct.Struct("<4sHHIqqII")
HEADER_BYTES = _HEADER.size  # 40: the arrays start 8-byte aligned.
_PAD = (-HEADER_BYTES) % 8
_ARRAYS = (
    ("tokens", "<i4"),
    ("rollout_logp", "<f4"),
    ("policy_version", "<i4"),
    ("rewards", "<f4"),
    ("action_mask", "u1"),
)


def encode(traj: Trajectory) -> list:
  """Buffers whose concatenation is the record (for ``RingWriter.write``)."""
  task = traj.task.encode("utf-8")
  error = traj.error.encode("utf-8")
  experts = traj.routed_experts
  m, k = (0, 0) if experts is None else experts.shape[1:]
  header = _HEADER.pack(
      _MAGIC, _VERSION, int(traj.finish_reason), traj.length,
      int(traj.prompt_id), int(traj.group_id), len(task), len(error), m, k,
  ) + b"\0" * _PAD
  bufs = [header]
  for field, dtype in _ARRAYS:
    if field == "action_mask" and experts is not None:
      bufs.append(np.ascontiguousarray(experts, dtype="<u2"))
    bufs.append(np.ascontiguousarray(getattr(traj, field), dtype=dtype))
  bufs.append(task + error)
  return bufs


def decode(buf) -> Trajectory:
  """A Trajectory whose arrays are NumPy views into ``buf``."""
  mv = memoryview(buf).cast("B")
  if mv.nbytes < HEADER_BYTES:
    raise ValueError(
        f"Trajectory record of {mv.nbytes} bytes is shorter than its "
        f"{HEADER_BYTES}-byte header: not produced by trajectory.encode."
    )
  magic, version = struct.unpack_from("<4sH", mv, 0)
  if magic != _MAGIC or version not in (1, _VERSION):
    raise ValueError(
        f"Not a trajectory record (magic {magic!r}, version {version}; "
        f"expected {_MAGIC!r} v1 or v{_VERSION}): the ring carries raw "
        "payloads or another codec version."
    )
  if version == 1:
    fields, m, k = _HEADER_V1.unpack_from(mv, 0), 0, 0
  else:
    *fields, m, k = _HEADER.unpack_from(mv, 0)
  _, _, finish, length, prompt_id, group_id, n_task, n_err = fields
  start = HEADER_BYTES + _PAD if version == _VERSION else 40
  expected = start + (17 + 2 * m * k) * length + n_task + n_err
  if mv.nbytes != expected:
    raise ValueError(
        f"Trajectory record has {mv.nbytes} bytes; its header says {expected} "
        f"(T={length}). The record is truncated or corrupted."
    )
  off = start
  arrays = {}
  for field, dtype in _ARRAYS:
    if field == "action_mask" and m * k:
      arr = np.frombuffer(mv, dtype="<u2", count=length * m * k, offset=off)
      arrays["routed_experts"] = arr.astype(np.uint16, copy=False).reshape(
          length, m, k)
      off += arr.nbytes
    arr = np.frombuffer(mv, dtype=dtype, count=length, offset=off)
    arrays[field] = arr.astype(arr.dtype.newbyteorder("="), copy=False)
    off += arr.nbytes
  task = bytes(mv[off:off + n_task]).decode("utf-8")
  error = bytes(mv[off + n_task:off + n_task + n_err]).decode("utf-8")
  return Trajectory(
      prompt_id=prompt_id, task=task, finish_reason=FinishReason(finish),
      group_id=group_id, error=error, **arrays,
  )


# ------------------------------------------------------- the [B, T] batch ---
#
# What the trainer consumes (docs/design/data_path.md "Trajectory record and
# batch"): the trajectory stream pads each admitted record to a row of fixed
# length T (``pad_row``), grain stacks B rows and ``with_group_index`` adds the
# dense group index the group estimators (GRPO family) reduce over.

# Per-token fields, [B, T]: dtype and padding value (None: the pad token).
TOKEN_FIELDS = {
    "tokens": (np.int32, None),
    "action_mask": (np.uint8, 0),  # 1 on policy-sampled tokens.
    "rollout_logp": (np.float32, 0.0),
    "policy_version": (np.int32, NO_VERSION),
    "rewards": (np.float32, 0.0),
    "attention_mask": (np.bool_, False),  # True on real tokens.
}
# A MoE policy's rows also hold "routed_experts", int32 [B, T, M, k] (0 on
# padding; Trajectory.routed_experts).
# Per-row fields, [B], all int32.
ROW_FIELDS = (
    "prompt_id",  # Trajectory.prompt_id.
    "group_id",  # Trajectory.group_id: rows of one prompt's rollouts.
    "staleness",  # Trainer version at consumption - oldest token version.
    "length",  # Tokens before padding / truncation.
    "group_index",  # Dense per batch (with_group_index).
)


def pad_row(traj: Trajectory, staleness: int, seq_len: int,
            pad_id: int = 0) -> dict[str, np.ndarray]:
  """One batch row of length ``seq_len`` (all fields but ``group_index``).

  A longer record keeps its first ``seq_len`` tokens and the rewards of the cut
  tail move onto the last kept action token, so its return is preserved.
  """
  t, n = seq_len, traj.length
  keep = min(n, t)
  row = {name: np.full(t, pad_id if fill is None else fill, dtype)
         for name, (dtype, fill) in TOKEN_FIELDS.items()}
  for name in ("tokens", "action_mask", "rollout_logp", "policy_version",
               "rewards"):
    row[name][:keep] = getattr(traj, name)[:keep]
  if n > t:
    acts = np.flatnonzero(traj.action_mask[:t])
    row["rewards"][acts[-1] if acts.size else t - 1] += float(
        traj.rewards[t:].sum())
  row["attention_mask"][:keep] = True
  if traj.routed_experts is not None:  # [T, M, k]: replayed by the trainer.
    row["routed_experts"] = np.zeros((t, *traj.routed_experts.shape[1:]),
                                     np.int32)
    row["routed_experts"][:keep] = traj.routed_experts[:keep]
  row["prompt_id"] = np.int32(traj.prompt_id)
  row["group_id"] = np.int32(traj.group_id)
  row["staleness"] = np.int32(staleness)
  row["length"] = np.int32(n)
  return row


def with_group_index(batch: dict[str, np.ndarray],
                     process_index: int = 0) -> dict[str, np.ndarray]:
  """``batch`` plus ``group_index``: rows of one ``group_id`` share an index.

  The indices are dense per host (0..groups-1) and offset by ``process_index
  * B`` so the groups of different hosts stay apart in the global batch.
  """
  _, inverse = np.unique(batch["group_id"], return_inverse=True)
  offset = process_index * len(batch["group_id"])
  return {**batch, "group_index": inverse.astype(np.int32) + offset}


# -------------------------------------------------------------- staleness ---


@dataclasses.dataclass(frozen=True)
class StalenessPolicy:
  """The staleness bound η and where it is enforced (docs/design/data_path.md
  "Staleness").

  ``max_staleness`` is the effective bound: ``train.max_staleness`` in
  ``async`` mode, 0 in ``sync``/``group`` mode (strict generate→train
  alternation). The stream drops a trajectory whose staleness exceeds it
  (``keeps``, the consumption filter). The sampler starts an episode batch
  only if the train step it feeds is at most ``admission_bound`` steps ahead
  of the trainer (``admits``); weights held back by ``publish_lag`` use up
  that much of the bound.
  """

  max_staleness: int | None = None  # None: no bound (tests, tools).
  publish_lag: int = 0

  @classmethod
  def from_config(cls, config) -> "StalenessPolicy":
    mode = str(config.train.mode)
    bound = 0 if mode in ("sync", "group") else int(config.train.max_staleness)
    return cls(bound, int(config.train.publish_lag))

  @property
  def admission_bound(self) -> int:
    return self.max_staleness - self.publish_lag

  def admits(self, target_step: int, trainer_step: int) -> bool:
    """Whether the sampler may start work for train step ``target_step``."""
    return target_step - trainer_step <= self.admission_bound

  def keeps(self, staleness: int) -> bool:
    """Whether the trainer may consume a trajectory this stale.

    Negative staleness (tokens from a version the trainer has not reached)
    cannot come from this run's weights: never kept.
    """
    if staleness < 0:
      return False
    return self.max_staleness is None or staleness <= self.max_staleness
