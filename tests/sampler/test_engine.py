"""Tests for sao_jax.sampler.engine (the native `Rollout`) and its feed:
slots, refill, in-flight weight swaps, exactly once."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.envs import base
from sao_jax.envs import longtail
from sao_jax.envs import reasoning_gym_env as rg_env
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Transformer
from sao_jax.sampler import engine as engine_lib
from sao_jax.sampler import feed as feed_lib
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler.process import SamplerStats
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.train import metrics as metrics_lib

import tiny_models
import tiny_settings
import trajectory_logp

pytestmark = pytest.mark.slow

_TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return tiny_settings.arithmetic_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def model(tok):
  cfg = ModelConfig.tiny(vocab_size=tok.vocab_size)
  x = jnp.zeros((1, 4), jnp.int32)
  params = {v: tiny_models.init_params(  # One compile for both versions.
      Transformer(cfg), jax.random.PRNGKey(v), x, x, x == 0)["params"]
            for v in (0, 1)}
  return cfg, params


class _TurnsEnv(base.Environment):
  """Task t needs 1 + t % 3 actions (long-ish tail of turns); the reply to
  each action is an observation whose length depends on t; slow on t % 4 == 1
  (an env call of one slot must not stall the others)."""

  name = "turns"

  def reset(self, task):
    self.prompt_id, self._left = task, 1 + task % 3
    return f"<|user|>question {task}<|end|><|assistant|>"

  def step(self, action_text):
    if self.prompt_id % 4 == 1:
      time.sleep(0.05)
    self._left -= 1
    return base.StepResult("<|tool_result|>" + "7" * (1 + self.prompt_id % 5),
                           1.0, self._left == 0, {})


def _run(tok, model, *, slots, episodes, start=0, swap_after=None,
         kv_on_swap="recompute", sampling=SamplingParams(_TEMPERATURE),
         refill=True, stop_after=None, skip=frozenset(), n_rollouts=1):
  """Runs the engine over `episodes` episodes; returns (trajs, stats, feed)."""
  cfg, params = model
  out, stats, polls = [], SamplerStats(), []

  def weights():
    polls.append(None)
    v = 0 if swap_after is None or len(polls) <= swap_after else 1
    return params[v], v

  def outbox(trajs):
    out.extend(trajs)
    return True

  limit = episodes if stop_after is None else stop_after
  settings = interface.RolloutSettings(
      interface.EngineOptions(
          num_slots=slots, decode_chunk=4, weight_poll_tokens=4,
          refill=refill, kv_on_swap=kv_on_swap, env_threads=2,
          n_rollouts=n_rollouts),
      rollout.RolloutLimits(max_turns=3, max_total_tokens=80,
                            max_new_tokens_per_turn=12),
      sampling, stop_ids=tuple(range(4, tok.vocab_size, 9)))
  engine = engine_lib.NativeRollout(
      settings, model_config=cfg, tokenizer=tok,
      envs=[_TurnsEnv() for _ in range(slots)], weights=weights, stats=stats,
      rng=jax.random.PRNGKey(3))
  feed = feed_lib.EpisodeFeed(
      task_of=lambda draw: draw, outbox=outbox, stats=stats,
      staleness=StalenessPolicy(max_staleness=0), train_batch=1,
      trainer_step=lambda: start + episodes - 1, n_rollouts=n_rollouts,
      start=start, skip=skip)
  engine.run(feed, lambda: len(out) >= limit)
  return out, stats, feed


@pytest.mark.parametrize("kv_on_swap", ["recompute", "keep"])
def test_rollout_logp_matches_trainer_under_each_tokens_version(
    tok, model, kv_on_swap):
  cfg, params = model
  trajs, stats, _ = _run(tok, model, slots=3, episodes=10, swap_after=6,
                         kv_on_swap=kv_on_swap)
  assert sorted(t.group_id for t in trajs) == list(range(10))  # Each once.
  refs = {v: trajectory_logp.trainer_logp(trajs, cfg, p, _TEMPERATURE)
          for v, p in params.items()}
  crossed = refilled = 0
  for i, t in enumerate(trajs):
    am = t.action_mask.astype(bool)
    versions = set(np.unique(t.policy_version[am]))
    assert versions <= {0, 1}
    assert t.staleness(1) == 1 - min(versions)
    crossed += len(versions) == 2
    refilled += t.group_id >= 3  # Started in a slot a finished one left.
    if kv_on_swap == "keep" and len(versions) == 2:
      # Tokens before the swap are exact; after it, the kept keys/values
      # of the older version are in their context (documented).
      sel = am & (t.policy_version == 0)
      np.testing.assert_allclose(t.rollout_logp[sel],
                                 refs[0][i, :t.length][sel], atol=1e-4)
      continue
    for v in versions:
      sel = am & (t.policy_version == v)
      np.testing.assert_allclose(t.rollout_logp[sel],
                                 refs[v][i, :t.length][sel], atol=1e-4)
  assert crossed >= 1 and refilled >= 5
  stale = stats.kv_cache_stale_tokens
  assert stale > 0 if kv_on_swap == "keep" else stale == 0


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True),
                                      SamplingParams(_TEMPERATURE)])
def test_refilled_slot_does_not_see_previous_occupant(tok, model, sampling):
  together, _, _ = _run(tok, model, slots=2, episodes=7, sampling=sampling)
  assert max(t.group_id for t in together) == 6  # Slots were refilled.
  for t in together:
    alone, _, _ = _run(tok, model, slots=1, episodes=1, start=t.group_id,
                       sampling=sampling)
    np.testing.assert_array_equal(alone[0].tokens, t.tokens)
    np.testing.assert_array_equal(alone[0].action_mask, t.action_mask)


def test_every_episode_once_or_aborted_across_stop_and_resume(tok, model):
  first, stats, feed = _run(tok, model, slots=4, episodes=12, stop_after=5)
  done = {t.group_id for t in first}
  assert len(done) == len(first) >= 5
  # Started = written + abandoned in flight (counted).
  assert feed.next_episode == len(first) + stats.episodes_aborted
  assert stats.episodes == len(first)
  # Resume from the lowest episode not written, skipping those written.
  low = min(set(range(feed.next_episode)) - done)
  second, _, _ = _run(tok, model, slots=4, episodes=12 - low, start=low,
                      skip=frozenset(done), stop_after=12 - len(done))
  ids = sorted([t.group_id for t in first] + [t.group_id for t in second])
  assert ids == list(range(12))


def test_batch_mode_waits_for_the_slowest_episode(tok, model):
  batch, bstats, _ = _run(tok, model, slots=4, episodes=8, refill=False)
  cont, cstats, _ = _run(tok, model, slots=4, episodes=8)
  # Batch mode: episodes 4..7 start only after all of 0..3 are written.
  order = [t.group_id for t in batch]
  assert set(order[:4]) == {0, 1, 2, 3}
  assert sorted(t.group_id for t in cont) == list(range(8))
  # (Which is higher depends on env-thread timing; both are shares.)
  for stats in (bstats, cstats):
    assert 0 < stats.decode_occupancy() <= 1
  for t in batch + cont:
    assert t.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_longtail_env_budgets_span_16x_and_the_engine_keeps_them(tok, model):
  levels = [longtail.length_level(t, 5) for t in range(4000)]
  counts = np.bincount(levels, minlength=5) / len(levels)
  # Geometric: half at level 0, a quarter at 1, ...; the last takes the rest.
  np.testing.assert_allclose(counts, [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16],
                             atol=0.03)
  tasks = rg_env.ReasoningGymTasks("basic_arithmetic", {}, seed=0, size=64)
  cfg, params = model
  chosen = [next(t for t in range(64) if levels[t] == lv and t % 2 == k)
            for lv in range(5) for k in (0, 1)]  # Two tasks per level.
  out = []
  stats = SamplerStats()
  engine = engine_lib.NativeRollout(
      interface.RolloutSettings(
          interface.EngineOptions(num_slots=4),
          rollout.RolloutLimits(max_turns=2, max_total_tokens=256,
                                max_new_tokens_per_turn=128), stop_ids=()),
      model_config=cfg, tokenizer=tok,
      envs=[longtail.LongTailToolEnv(tasks) for _ in range(4)],
      weights=lambda: (params[0], 0), stats=stats, rng=jax.random.PRNGKey(0))
  engine.run(feed_lib.EpisodeFeed(
      task_of=lambda draw: chosen[draw % len(chosen)],
      outbox=lambda t: out.extend(t) or True, stats=stats),
             lambda: len(out) >= 2 * len(chosen))
  lengths = {t.prompt_id: t.num_action_tokens for t in out}
  for task, n in lengths.items():  # No stop token: actions use the budget.
    assert n == 8 << longtail.length_level(task, 5)
  assert max(lengths.values()) == 16 * min(lengths.values())
  assert all(t.finish_reason == FinishReason.LENGTH for t in out)


def test_longtail_tool_calls_follow_the_task_and_do_not_hold_other_slots(
    tok, model):
  calls = [longtail.tool_calls_of(t, 3) for t in range(4000)]
  np.testing.assert_allclose(np.bincount(calls) / len(calls),
                             [1 / 2, 1 / 4, 1 / 8, 1 / 8], atol=0.03)
  tasks = rg_env.ReasoningGymTasks("basic_arithmetic", {}, seed=0, size=64)
  # Slot 0 gets a task with 3 slow calls, the others tasks without calls.
  slow = next(t for t in range(64) if calls[t] == 3)
  fast = [t for t in range(64) if calls[t] == 0][:7]
  chosen = [slow] + fast
  cfg, params = model
  out = []
  stats = SamplerStats()
  engine = engine_lib.NativeRollout(
      interface.RolloutSettings(
          interface.EngineOptions(num_slots=4, env_threads=4),
          rollout.RolloutLimits(max_turns=5, max_total_tokens=256,
                                max_new_tokens_per_turn=128), stop_ids=()),
      model_config=cfg, tokenizer=tok,
      envs=[longtail.LongTailToolEnv(tasks, min_tokens=4, levels=1,
                                     tool_calls=3, tool_latency_s=0.2)
            for _ in range(4)],
      weights=lambda: (params[0], 0), stats=stats, rng=jax.random.PRNGKey(0))
  engine.run(feed_lib.EpisodeFeed(
      task_of=lambda draw: chosen[draw] if draw < 8 else fast[draw % 7],
      outbox=lambda t: out.extend(t) or True, stats=stats),
             lambda: slow in [t.prompt_id for t in out])
  for t in out:
    am = t.action_mask.astype(int)
    segments = int(np.sum(np.diff(np.concatenate([[0], am])) == 1))
    # k calls and the answer, each action exactly its length (no stop token).
    assert segments == calls[t.prompt_id] + 1, t.prompt_id
    assert t.num_action_tokens == 4 * segments
    assert t.finish_reason == FinishReason.STOP
  # The slow episode (0.6 s of tool calls) is written after at least the
  # seven fast ones: three ran beside it, the others in slots they freed.
  assert [t.prompt_id for t in out].index(slow) >= 7


def test_version_span_is_newest_minus_oldest_action_version():
  versions = np.array([[-1, 3, 3, 5, -1], [-1, -1, 2, 2, 2], [-1] * 5])
  mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0] * 5], np.uint8)
  np.testing.assert_array_equal(metrics_lib.version_span(versions, mask),
                                [2, 0, 0])


def test_rollouts_of_one_prompt_are_written_together(tok, model):
  trajs, _, _ = _run(tok, model, slots=4, episodes=8, n_rollouts=2)
  ids = [t.group_id for t in trajs]
  assert sorted(ids) == [0, 0, 1, 1, 2, 2, 3, 3]
  assert all(ids[i] == ids[i + 1] for i in range(0, len(ids), 2))
  for a, b in zip(trajs[::2], trajs[1::2]):
    assert a.prompt_id == b.prompt_id
