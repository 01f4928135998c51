"""Tests for sao_jax.sampler.rollout (the episode rules) through the
`Rollout` interface: multi-turn episodes, errors, limits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import base
from sao_jax.envs import reasoning_gym_env as rg_env
from sao_jax.envs import tool_env
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Transformer
from sao_jax.sampler import engine as engine_lib
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.sampler.stats import SamplerStats
from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import NO_VERSION
import scripted_policy
import trajectory_logp


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  corpus = tok_lib.task_corpus(
      ("basic_arithmetic", "chain_sum", "leg_counting", "letter_counting"),
      n=100, seed=0)
  return tok_lib.train_tokenizer(
      corpus, tmp_path_factory.mktemp("tok") / "t.model", 400, seed=0)


@pytest.fixture(scope="module")
def tasks():
  return rg_env.ReasoningGymTasks("basic_arithmetic", {"max_terms": 3},
                                  seed=7, size=4)


class _RaisingEnv(tool_env.ToolEnv):

  def step(self, action_text):
    raise RuntimeError("scorer crashed on purpose")


class _EchoEnv(base.Environment):
  """Never done: answers every action with a fixed observation."""

  name = "echo"

  def __init__(self, prompt, obs):
    self._prompt, self._obs = prompt, obs

  def reset(self, task):
    self.prompt_id = task
    return self._prompt

  def step(self, action_text):
    return base.StepResult(self._obs, 0.5, False, {})


def test_scripted_tool_call_episode(tok, tasks):
  entry = tasks.entry(0)
  expr, answer = entry["metadata"]["expression"], entry["answer"]
  call = tok.encode("Compute " + tok_lib.format_tool_call(expr))
  final = tok.encode(answer + tok_lib.END)
  scripts = [call + final, call + final, tok.encode("1 2 3 4 5 6 7 8 9"),
             call * 3]
  envs = [tool_env.ToolEnv(tasks), _RaisingEnv(tasks), tool_env.ToolEnv(tasks),
          tool_env.ToolEnv(tasks)]
  limits = rollout.RolloutLimits(max_turns=2, max_total_tokens=400,
                                 max_new_tokens_per_turn=64)
  trajs, policy = scripted_policy.play(scripts, envs, [0, 1, 2, 3], tok,
                                       limits, version=3, logprob=-0.25)

  good = trajs[0]
  prompt = tok.encode(tok_lib.format_prompt(entry["question"]))
  obs = tok.encode(tok_lib.format_tool_result(
      tool_env.format_number(tool_env.calculate(expr))))
  assert tok_lib.format_tool_result(answer) == tok.decode(obs)
  np.testing.assert_array_equal(good.tokens, prompt + call + obs + final)
  want_mask = [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * len(
      final)
  np.testing.assert_array_equal(good.action_mask, want_mask)
  am = good.action_mask.astype(bool)
  np.testing.assert_array_equal(good.rollout_logp, np.where(am, -0.25, 0.0))
  np.testing.assert_array_equal(good.policy_version,
                                np.where(am, 3, NO_VERSION))
  assert good.rewards[-1] == 1.0 and good.total_reward == 1.0
  assert good.finish_reason == FinishReason.STOP
  assert good.prompt_id == 7 and good.task == "basic_arithmetic+calc"
  # The policy saw the observation in its context.
  assert policy.contexts[0] == list(good.tokens)

  err = trajs[1]
  assert err.finish_reason == FinishReason.ERROR
  assert "scorer crashed on purpose" in err.error and "RuntimeError" in err.error
  assert err.total_reward == 0.0 and err.num_action_tokens == len(call)

  length = trajs[2]  # No stop token within the budget.
  assert length.finish_reason == FinishReason.LENGTH
  assert length.num_action_tokens == len(scripts[2])

  turns = trajs[3]  # Tool calls forever: stopped by max_turns.
  assert turns.finish_reason == FinishReason.TURNS
  assert turns.num_action_tokens == 2 * len(call)


def test_token_limit_and_reset_error(tok, tasks):
  class _BadReset(tool_env.ToolEnv):

    def reset(self, task):
      raise KeyError("no such task")

  entry = tasks.entry(1)
  call = tok.encode(tok_lib.format_tool_call(entry["metadata"]["expression"]))
  prompt_len = len(tok.encode(tok_lib.format_prompt(entry["question"])))
  limits = rollout.RolloutLimits(max_turns=5,
                                 max_total_tokens=prompt_len + len(call) + 3,
                                 max_new_tokens_per_turn=64)
  trajs, _ = scripted_policy.play(
      [call * 5, call], [tool_env.ToolEnv(tasks), _BadReset(tasks)], [1, 1],
      tok, limits)
  # The observation would not fit the token budget.
  assert trajs[0].finish_reason == FinishReason.LENGTH
  assert trajs[0].length == prompt_len + len(call)
  assert trajs[1].finish_reason == FinishReason.ERROR
  assert "KeyError" in trajs[1].error and trajs[1].length == 0


def _init_params(cfg, seed, scale=6.0):
  x = jnp.zeros((1, 4), jnp.int32)
  init = jax.jit(lambda k: Transformer(cfg).init(k, x, x, x > -1)["params"])
  p = nn.unbox(init(jax.random.PRNGKey(seed)))
  return jax.tree.map(lambda a: a * scale if a.ndim > 1 else a, p)


@pytest.mark.slow
def test_native_rollout_multi_turn_logprobs_and_versions(tok):
  """Evaluation's path (`interface.run_episodes`) with a real decoder and
  an in-flight weight swap: every action token's log-prob is the trainer's
  under the version it records."""
  cfg = ModelConfig.tiny(vocab_size=tok.vocab_size)
  versions = {0: _init_params(cfg, 0), 1: _init_params(cfg, 1)}
  calls = []

  def weights():  # Version 0 for the first three polls, then version 1.
    calls.append(None)
    v = 0 if len(calls) <= 3 else 1
    return versions[v], v

  temperature = 0.7
  limits = rollout.RolloutLimits(4, 96, 8)
  settings = interface.RolloutSettings(
      interface.EngineOptions(num_slots=2, decode_chunk=4,
                              weight_poll_tokens=4, kv_on_swap="recompute",
                              env_threads=2),
      limits, SamplingParams(temperature=temperature),
      # Many stop tokens so a random model ends its segments early.
      stop_ids=tuple(range(4, tok.vocab_size, 3)))
  envs = [_EchoEnv("<|user|>hi<|end|><|assistant|>", "<|tool_result|>ok 12"),
          _EchoEnv("<|user|>a longer question here<|end|><|assistant|>",
                   "<|tool_result|>x")]
  engine = engine_lib.NativeRollout(
      settings, model_config=cfg, tokenizer=tok, envs=envs, weights=weights,
      stats=SamplerStats(), rng=jax.random.PRNGKey(1))
  assert isinstance(engine, interface.Rollout)
  trajs = interface.run_episodes(engine, [5, 6])
  assert [t.prompt_id for t in trajs] == [5, 6]
  assert [t.group_id for t in trajs] == [0, 1]
  refs = {v: trajectory_logp.trainer_logp(trajs, cfg, p, temperature)
          for v, p in versions.items()}
  checked = {0: 0, 1: 0}
  for i, t in enumerate(trajs):
    assert t.finish_reason in (FinishReason.TURNS, FinishReason.LENGTH)
    am = t.action_mask.astype(bool)
    assert set(np.unique(t.policy_version[am])) <= {0, 1}
    assert (t.policy_version[~am] == NO_VERSION).all()
    assert np.count_nonzero(np.diff(am.astype(int)) == 1) >= 2  # Multi-turn.
    for v in versions:
      sel = am & (t.policy_version == v)
      np.testing.assert_allclose(t.rollout_logp[sel], refs[v][i, :t.length][sel],
                                 atol=1e-4)
      checked[v] += sel.sum()
  assert checked[0] > 0 and checked[1] > 0
