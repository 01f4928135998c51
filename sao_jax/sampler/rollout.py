"""The episode rules every rollout engine shares: limits, turns, endings.

An episode is a prompt (``env.reset``), then turns: the policy generates an
action until a stop token (a tool call `<|/tool_call|>`, the end of turn
`<|end|>` or eos) or its budget; the action text goes to the environment
(``env.step``); a non-final observation is appended to the context with
action mask 0 and the policy goes on. It ends with a `FinishReason`: STOP
(env says done), LENGTH (token budget: the action did not stop within its
budget, or the next observation would not fit ``max_total_tokens``), TURNS
(``max_turns`` actions taken), ERROR (the env raised or timed out, or the
prompt alone is too long; the message is kept, other episodes go on).

`Episode` holds one episode's `EpisodeRecord` and applies these rules; an
engine (``engine.py``, ``vllm_engine.py``) only generates tokens and calls
it, so every engine ends its episodes the same way. Every action token
records its sampled log-prob and the policy version that sampled it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

from absl import logging
import numpy as np

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs.base import Environment
from sao_jax.sampler.generate import MIN_BUCKET
from sao_jax.data.trajectory import EpisodeRecord
from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import Trajectory

# What an engine does after an action segment (`Episode.after_segment`).
GENERATE = "generate"  # The action goes on.
STEP = "step"  # The action ended: ``env.step`` is due (`Episode.env_step`).
OVER = "over"  # The episode ended (build its trajectory).


@dataclasses.dataclass(frozen=True)
class RolloutLimits:
  """Episode limits.

  Attributes:
    max_turns: Maximum action segments per episode.
    max_total_tokens: Maximum trajectory length (prompt + actions + obs).
    max_new_tokens_per_turn: Maximum tokens in one action segment.
    min_prompt_bucket: Shortest padding of prompts and observations.
    step_timeout_s: Longest an environment's ``reset`` or ``step`` may take;
      a call that runs longer ends its episode as an ERROR row (the call's
      thread is abandoned). 0: no limit.
  """

  max_turns: int = 4
  max_total_tokens: int = 512
  max_new_tokens_per_turn: int = 128
  min_prompt_bucket: int = MIN_BUCKET
  step_timeout_s: float = 0.0

  @classmethod
  def from_config(cls, config: Any) -> "RolloutLimits":
    """Limits from an experiment config's ``env`` and ``sampler`` sections."""
    return cls(max_turns=int(config.env.max_turns),
               max_total_tokens=int(config.sampler.max_total_tokens),
               max_new_tokens_per_turn=int(config.sampler.max_new_tokens),
               min_prompt_bucket=int(config.sampler.min_prompt_bucket),
               step_timeout_s=float(config.env.step_timeout_s))

  def cache_len(self) -> int:
    """KV cache slots per row that always suffice: a row holds only its own
    tokens (per-row cache ends, `generate.py`), at most ``max_total_tokens``
    (rounded up to a multiple of 8)."""
    return -(-self.max_total_tokens // 8) * 8


def attach_experts(record: EpisodeRecord, experts: np.ndarray | None
                   ) -> None:
  """Sets ``record``'s routing (R3) to ``experts`` [n, M, k], the sampler's
  record of every token fed for it, which must cover the record's tokens."""
  if experts is None:
    return
  n = len(record.tokens)
  if len(experts) < n:
    raise ValueError(
        f"The sampler recorded experts for {len(experts)} tokens of an "
        f"episode of {n}; every token fed must be routed and recorded.")
  record.experts = [np.asarray(experts[:n], np.uint16)]


def action_budget(env: Environment, limits: RolloutLimits,
                  length: int) -> int:
  """Tokens the next action may take: the turn and total limits, and the
  environment's own cap (`Environment.action_budget`)."""
  budget = min(limits.max_new_tokens_per_turn,
               limits.max_total_tokens - length)
  own = env.action_budget()
  return budget if own is None else min(budget, int(own))


def num_slots(config: Any) -> int:
  """Episodes the sampler keeps in flight: ``sampler.num_slots`` (0: its
  ``batch_size``), a multiple of ``n_rollouts`` (a prompt's rollouts start
  together)."""
  n_roll = int(config.sampler.n_rollouts)
  slots = int(config.sampler.num_slots) or int(config.sampler.batch_size)
  return max(n_roll, slots // n_roll * n_roll)


def data_wait_s(config: Any) -> tuple[float, str]:
  """The longest the trainer waits for a trajectory, and how it is derived.

  The episodes in flight (``num_slots``) at most: ``ring.get_timeout_s`` for
  their generation (and the sampler's start-up) plus their environment calls,
  counted as if made one after another (the env threads only shorten it),
  each bounded by ``env.step_timeout_s``: per episode at most a prompt length
  probe, the reset and ``env.max_turns`` steps.
  """
  episodes = num_slots(config)
  turns = int(config.env.max_turns)
  calls = episodes * (2 + turns)
  step_s = float(config.env.step_timeout_s)
  gen_s = float(config.ring.get_timeout_s)
  total = gen_s + calls * step_s
  return total, (
      f"{total:g} s = ring.get_timeout_s={gen_s:g} s (generation) + {calls} "
      f"env calls ({episodes} episodes x (probe, reset, {turns} steps)) x "
      f"env.step_timeout_s={step_s:g} s")


def default_stop_ids(tokenizer: tok_lib.Tokenizer) -> tuple[int, ...]:
  """End of turn, end of tool call, eos."""
  return tuple(tokenizer.stop_ids)


def call_with_timeout(fn: Callable[[], Any], timeout_s: float,
                      what: str) -> Any:
  """``fn()``, or ``TimeoutError`` if it runs longer than ``timeout_s`` (> 0).

  ``fn`` runs in a daemon thread, which is abandoned on timeout (Python
  cannot stop it); it never keeps the process from exiting.
  """
  if timeout_s <= 0:
    return fn()
  out: dict[str, Any] = {}

  def target():
    try:
      out["value"] = fn()
    except BaseException as e:  # pylint: disable=broad-except
      out["error"] = e

  worker = threading.Thread(target=target, name=what, daemon=True)
  worker.start()
  worker.join(timeout_s)
  if worker.is_alive():
    raise TimeoutError(f"{what} did not return within env.step_timeout_s="
                       f"{timeout_s:g} s")
  if "error" in out:
    raise out["error"]
  return out["value"]


def encode_observation(obs, tokenizer: tok_lib.Tokenizer) -> list[int]:
  """An observation (text or token ids) as token ids."""
  return tokenizer.encode(obs) if isinstance(obs, str) else [int(t) for t in obs]


def prompt_tokens(env: Environment, task: Any, tokenizer: tok_lib.Tokenizer,
                  limits: RolloutLimits) -> list[int]:
  """``env.reset(task)`` (within ``step_timeout_s``) as the policy's tokens."""
  env.set_template(tokenizer.template)
  return encode_observation(call_with_timeout(
      lambda: env.reset(task), limits.step_timeout_s, "env.reset"), tokenizer)




class Episode:
  """One episode: its record, its turn and the rules of how it goes on.

  An engine calls `begin` (the prompt to feed), then per generated segment
  `add_action` and `after_segment`; on `STEP` it runs `env_step` (off its
  decode loop: it may be slow) and hands the result to `env_result`, which
  returns the observation to feed or None when the episode is over.
  """

  def __init__(self, env: Environment, tokenizer: tok_lib.Tokenizer,
               limits: RolloutLimits, number: int = -1):
    self.env, self.tokenizer, self.limits = env, tokenizer, limits
    self.number = number  # The engine's episode number (-1: none).
    self.record = EpisodeRecord()
    self.turns = 0  # Actions handed to the environment.
    self.turn_left = 0  # Tokens the current action may still take.
    self.action: list[int] = []  # The current action's tokens.
    self.over = False

  def begin(self, task: Any) -> list[int] | None:
    """``env.reset(task)``: the prompt tokens, or None (an ERROR episode)."""
    try:
      prompt = prompt_tokens(self.env, task, self.tokenizer, self.limits)
      if len(prompt) >= self.limits.max_total_tokens:
        raise ValueError(f"prompt has {len(prompt)} tokens >= "
                         f"max_total_tokens={self.limits.max_total_tokens}")
    except Exception as e:  # pylint: disable=broad-except
      self.fail("reset", e)
      return None
    self.record.add(prompt, 0)
    self._next_turn()
    return prompt

  def _next_turn(self) -> None:
    self.action = []
    self.turn_left = action_budget(self.env, self.limits,
                                   len(self.record.tokens))

  def add_action(self, tokens: Sequence[int], logprobs: Sequence[float],
                 versions: int | Sequence[int]) -> None:
    """Appends sampled tokens, their log-probs and the policy version of
    each (one for all, or one per token)."""
    n = len(tokens)
    per_token = np.broadcast_to(np.asarray(versions, np.int64), (n,))
    start = 0
    for end in list(np.flatnonzero(np.diff(per_token)) + 1) + [n]:
      if end > start:
        self.record.add(tokens[start:end], 1, logprobs[start:end],
                        int(per_token[start]))
      start = end
    self.action.extend(int(t) for t in tokens)
    self.turn_left -= n

  def after_segment(self, stopped: bool, ended: bool = False) -> str:
    """`GENERATE`, `STEP` or `OVER` after a segment.

    Args:
      stopped: it ended on a stop token.
      ended: the engine cannot generate more of this action (it neither
        stopped nor used the budget it was given: the engine's own length
        limit); as if the action's budget ran out.
    """
    if ended and not stopped:
      self.turn_left = 0
    if stopped or (self.turn_left <= 0 and self.env.fixed_length_actions):
      self.turns += 1
      return STEP
    if self.turn_left <= 0:
      self.record.finish = FinishReason.LENGTH
      self.over = True
      return OVER
    return GENERATE

  def env_step(self, version: int | None) -> tuple[list[int], float, bool]:
    """``env.step`` on the action: (observation tokens, reward, done).

    Runs on an engine's worker thread, within ``step_timeout_s``.
    """
    self.env.set_policy_version(version)
    text = self.tokenizer.decode(self.action)
    obs, reward, done, _ = call_with_timeout(
        lambda: self.env.step(text), self.limits.step_timeout_s, "env.step")
    obs_tokens = [] if done else encode_observation(obs, self.tokenizer)
    return obs_tokens, float(reward), bool(done)

  def env_result(self, result: tuple[list[int], float, bool]
                 ) -> list[int] | None:
    """Records an `env_step` result; the observation to feed before the
    next action, or None when the episode is over."""
    obs_tokens, reward, done = result
    record = self.record
    if self.action:
      record.rewards[-1] += reward
    if done:
      record.finish = FinishReason.STOP
    elif len(record.tokens) + len(obs_tokens) >= self.limits.max_total_tokens:
      record.finish = FinishReason.LENGTH
    else:
      record.add(obs_tokens, 0)
      if self.turns < self.limits.max_turns:
        self._next_turn()
        return obs_tokens
    self.over = True
    return None

  def fail(self, what: str, e: BaseException) -> None:
    """Ends the episode as ERROR (``what``: 'reset' or 'step')."""
    self.record.finish = FinishReason.ERROR
    self.record.error = f"{what}: {type(e).__name__}: {e}"
    self.over = True
    logging.warning("sampler: episode %d (%s) failed in %s", self.number,
                    self.env.name, self.record.error)

  def trajectory(self, experts: np.ndarray | None = None) -> Trajectory:
    """The finished episode's `Trajectory` (with the routing of every token
    for a MoE policy, `attach_experts`)."""
    attach_experts(self.record, experts)
    return self.record.trajectory(self.env)
