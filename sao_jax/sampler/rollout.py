"""Episode runner: multi-turn agentic trajectories over a batch of episodes.

Per turn, every live row's policy generates until a stop token (a tool call
`<|/tool_call|>`, the end of turn `<|end|>` or eos) or its budget; the action
text goes to that row's environment; a non-final observation is appended to
the context with action mask 0 and the row continues. Rows end with a
`FinishReason`: STOP (env says done), LENGTH (token budget: the action did not
stop within its budget, or the next observation would not fit
`max_total_tokens`), TURNS (`max_turns` actions taken), ERROR (the env raised;
the message is kept, the other rows go on).

Policies are pluggable (`Policy`): `ModelPolicy` samples with
`sampler.generate.Generator` and calls `params_provider() -> (params,
version)` before every turn, switching to newer weights between turns (the
cache is recomputed under them); tests plug in a scripted policy. Every
action token records the version of the policy that sampled it.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from typing import Any, Callable, Sequence

from absl import logging
import jax
import numpy as np

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs.base import Environment
from sao_jax.models.config import ModelConfig
from sao_jax.sampler.generate import MIN_BUCKET
from sao_jax.sampler.generate import Generator
from sao_jax.sampler.generate import Segment
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.data.trajectory import EpisodeRecord
from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import NO_VERSION
from sao_jax.data.trajectory import Trajectory

ParamsProvider = Callable[[], tuple[Any, int]]


class Policy(abc.ABC):
  """Generates action segments for a batch of rows, turn by turn."""

  @abc.abstractmethod
  def start(self, prompts: Sequence[Sequence[int]]) -> None:
    """Begins a batch; one prompt per row (empty for rows that are not live)."""

  @abc.abstractmethod
  def observe(self, chunks: Sequence[Sequence[int]]) -> None:
    """Appends observation tokens per row (empty for most rows)."""

  @abc.abstractmethod
  def refresh(self) -> int:
    """Called before each turn; returns the policy version for that turn."""

  @abc.abstractmethod
  def act(self, stop_ids: Sequence[int], budgets: np.ndarray,
          active: np.ndarray) -> list[Segment]:
    """One action segment per row (empty for inactive rows)."""

  def row_experts(self, i: int) -> np.ndarray | None:
    """A MoE policy's experts of every token fed for row ``i`` so far,
    uint16 [n, M, k] (routing replay, R3); None: no routing to record."""
    del i
    return None


class ModelPolicy(Policy):
  """Samples from the `Transformer`; picks up new weights between turns."""

  def __init__(self, config: ModelConfig, params_provider: ParamsProvider,
               max_len: int, sampling: SamplingParams = SamplingParams(),
               rng: jax.Array | None = None, min_bucket: int = MIN_BUCKET,
               row_subsets: bool = True):
    """Args:
      config: model config.
      params_provider: returns (params, version); called before every turn.
      max_len: KV cache slots per row (`RolloutLimits.cache_len()` is safe).
      sampling: sampling parameters (the trainer must use the same temperature).
      rng: PRNG key.
      min_bucket: shortest prompt/chunk padding (`Generator`).
      row_subsets: run only the rows with work (`Generator`).
    """
    self.config = config
    self.params_provider = params_provider
    self.max_len = max_len
    self.sampling = sampling
    self.min_bucket = min_bucket
    self.row_subsets = row_subsets
    self._rng = jax.random.PRNGKey(0) if rng is None else rng
    self._gen: Generator | None = None
    self.version = NO_VERSION

  def start(self, prompts):
    params, self.version = self.params_provider()
    self._rng, key = jax.random.split(self._rng)
    self._gen = Generator(self.config, params, len(prompts), self.max_len,
                          self.sampling, key, self.min_bucket,
                          self.row_subsets)
    self._gen.append(prompts)

  def observe(self, chunks):
    self._gen.append(chunks)

  def refresh(self) -> int:
    params, version = self.params_provider()
    if version != self.version:
      logging.info("ModelPolicy: weights %d -> %d between turns.",
                   self.version, version)
      self._gen.set_params(params)
      self.version = version
    return self.version

  def act(self, stop_ids, budgets, active):
    return self._gen.generate(list(stop_ids), budgets, active)

  def row_experts(self, i):
    return self._gen.row_experts(i)


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


def run_episodes(policy: Policy, envs: Sequence[Environment],
                 tasks: Sequence[Any], tokenizer: tok_lib.Tokenizer,
                 limits: RolloutLimits = RolloutLimits(),
                 stop_ids: Sequence[int] | None = None) -> list[Trajectory]:
  """Runs one episode per (env, task) row; returns one `Trajectory` per row.

  Args:
    policy: the policy (`ModelPolicy`, or a test's scripted one).
    envs: one environment instance per row.
    tasks: one task per row, passed to `env.reset`.
    tokenizer: encodes observations and decodes actions.
    limits: turn and token limits.
    stop_ids: tokens that end an action segment (default `default_stop_ids`).
  """
  if len(envs) != len(tasks):
    raise ValueError(f"{len(envs)} envs for {len(tasks)} tasks; need one each.")
  stop_ids = tuple(default_stop_ids(tokenizer) if stop_ids is None else stop_ids)
  rows = [EpisodeRecord() for _ in envs]

  def fail(i: int, what: str, e: Exception) -> None:
    rows[i].finish = FinishReason.ERROR
    rows[i].error = f"{what}: {type(e).__name__}: {e}"
    logging.warning("Episode %d (%s) failed in %s", i, envs[i].name,
                    rows[i].error)

  prompts = []
  for i, (env, task) in enumerate(zip(envs, tasks)):
    try:
      prompt = prompt_tokens(env, task, tokenizer, limits)
      if len(prompt) >= limits.max_total_tokens:
        raise ValueError(f"prompt has {len(prompt)} tokens >= max_total_tokens="
                         f"{limits.max_total_tokens}")
      rows[i].add(prompt, 0)
    except Exception as e:  # pylint: disable=broad-except
      fail(i, "reset", e)
    prompts.append(rows[i].tokens)
  policy.start([list(p) for p in prompts])

  for _ in range(limits.max_turns):
    active = np.array([r.finish is None for r in rows])
    if not active.any():
      break
    version = policy.refresh()
    budgets = np.array([action_budget(env, limits, len(r.tokens))
                        for env, r in zip(envs, rows)], np.int32)
    segments = policy.act(stop_ids, budgets, active)
    chunks: list[list[int]] = [[] for _ in rows]
    for i, (row, seg) in enumerate(zip(rows, segments)):
      if not active[i]:
        continue
      row.add(seg.tokens, 1, seg.logprobs, version)
      if not (seg.stopped or envs[i].fixed_length_actions):
        row.finish = FinishReason.LENGTH
        continue
      try:
        envs[i].set_policy_version(version)
        text = tokenizer.decode(seg.tokens)
        obs, reward, done, _ = call_with_timeout(
            lambda: envs[i].step(text),  # pylint: disable=cell-var-from-loop
            limits.step_timeout_s, "env.step")
        obs_tokens = encode_observation(obs, tokenizer) if not done else []
      except Exception as e:  # pylint: disable=broad-except
        fail(i, "step", e)
        continue
      if len(seg.tokens):
        row.rewards[-1] += float(reward)
      if done:
        row.finish = FinishReason.STOP
      elif len(row.tokens) + len(obs_tokens) >= limits.max_total_tokens:
        row.finish = FinishReason.LENGTH
      else:
        row.add(obs_tokens, 0)
        chunks[i] = obs_tokens
    if any(chunks):
      policy.observe(chunks)

  for i, row in enumerate(rows):
    attach_experts(row, policy.row_experts(i))
  return [row.trajectory(env) for env, row in zip(envs, rows)]
