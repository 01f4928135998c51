"""Defects every loss would share: SFT data, training episodes, the trainer's
batch and the held-out evaluation must agree on prompts, answers, rewards and
token alignment (issue 18's chain_sum diagnosis).

* an SFT demonstration replayed as a training episode gives the same tokens,
  the same action mask as the SFT loss mask, and full reward on its last action
  token (prompt template, answer format, scorer and reward placement agree);
* the held-out evaluation scores a policy's answers exactly as the training
  environments do (same env, same limits, greedy decoding);
* a real sampled episode, padded by the trainer's stream, is on-policy for the
  train step (ratio 1 on every action token) and its advantage lives on action
  tokens only, its reward on the last one.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from configs import chain_sum
import scripted_policy
from sao_jax import config_validation
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.data import stream as stream_lib
from sao_jax.envs import build as env_build
from sao_jax.envs import reasoning_gym_env as rg_env
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import engine as engine_lib
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.sampler.stats import SamplerStats
from sao_jax.train import evaluate as eval_lib
from sao_jax.train import step as step_lib
from sao_jax.train import warm_start

CHAIN_SUM = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
pytestmark = pytest.mark.slow  # A tokenizer and a model compile: ~40 s.

ARITHMETIC = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1,
              "operators": ("+", "-"), "allow_parentheses": False,
              "allow_negation": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  corpus = tok_lib.task_corpus(("basic_arithmetic", "chain_sum"), n=200,
                               seed=0)
  return tok_lib.train_tokenizer(
      corpus, tmp_path_factory.mktemp("tok") / "t.model", 312, seed=0)


def _config(env_name: str, dataset: str, dataset_config: dict,
            instruction: str = "",
            reward: str = "exact") -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.env = ml_collections.ConfigDict({
      "name": env_name, "dataset": dataset,
      "dataset_config": ml_collections.ConfigDict(dataset_config),
      "instruction": instruction, "reward": reward, "seed": 0, "size": 64,
      "eval_seed": 1000,
      "eval_size": 8, "max_turns": 3 if env_name == "tool" else 1,
      "max_tool_calls": 1, "styles": ("plain",), "style_change_steps": (),
      "step_timeout_s": 60.0})
  config.sampler = ml_collections.ConfigDict({
      "max_total_tokens": 128, "max_new_tokens": 32, "min_prompt_bucket": 8,
      "env_threads": 2})
  return config


def _actions(example) -> list[list[int]]:
  """The SFT example's action segments, one per assistant turn."""
  return [list(seg) for seg, trained in example if trained]


CASES = [
    ("reasoning_gym", "chain_sum", CHAIN_SUM, "", 0.0),
    ("reasoning_gym", "chain_sum", CHAIN_SUM, " Answer with a number.", 0.0),
    ("tool", "basic_arithmetic", ARITHMETIC, "", 0.5),
]


@pytest.mark.parametrize("env_name,dataset,dataset_config,instruction,tool",
                         CASES)
def test_sft_demonstration_replays_as_a_full_reward_episode(
    tok, env_name, dataset, dataset_config, instruction, tool):
  config = _config(env_name, dataset, dataset_config, instruction)
  tasks, _ = env_build.build_tasks(config.env)
  n = 6
  examples = warm_start.sft_examples(tasks, tok, n, max_len=128, tool_frac=tool,
                               instruction=instruction)
  assert len(examples) == n
  envs = env_build.make_envs(config.env, tasks, n)
  scripts = [[t for seg in _actions(ex) for t in seg] for ex in examples]
  trajs, _ = scripted_policy.play(scripts, envs, range(n), tok,
                                  rollout.RolloutLimits.from_config(config))
  for i, (ex, traj) in enumerate(zip(examples, trajs)):
    sft_tokens = [t for seg, _ in ex for t in seg]
    sft_mask = [int(trained) for seg, trained in ex for _ in seg]
    # Same prompt (template + question + instruction), same observations.
    assert traj.tokens.tolist() == sft_tokens, i
    assert traj.action_mask.tolist() == sft_mask, i
    # The demonstrated answer is accepted by the task's scorer ...
    assert traj.total_reward == 1.0, (i, tok.decode(sft_tokens))
    # ... and its reward sits on the last action token (the end of turn).
    last_action = np.flatnonzero(traj.action_mask)[-1]
    assert traj.rewards[last_action] == 1.0
    assert traj.tokens[last_action] == tok.token_id(tok_lib.END)
  if tool:
    assert sum(len(_actions(ex)) == 2 for ex in examples) == n // 2


def test_sft_length_errors_name_the_length_that_works(tok, caplog):
  config = _config("reasoning_gym", "chain_sum", CHAIN_SUM)
  tasks, _ = env_build.build_tasks(config.env)
  lengths = sorted(sum(len(seg) for seg, _ in ex)
                   for ex in warm_start.sft_examples(tasks, tok, 16, max_len=512))
  median, longest = int(np.median(lengths)), lengths[-1]
  with pytest.raises(ValueError) as info:
    warm_start.sft_examples(tasks, tok, 16, max_len=lengths[0] - 1)
  assert str(info.value) == (
      f"all 16 SFT demonstrations are longer than train.sft_max_len="
      f"{lengths[0] - 1}; the median needs {median} tokens, the longest "
      f"{longest}: raise train.sft_max_len to >= {longest}.")
  kept = warm_start.sft_examples(tasks, tok, 16, max_len=longest - 1)
  assert 0 < len(kept) == sum(n < longest for n in lengths) < 16
  assert (f"{16 - len(kept)} of 16 SFT demonstrations are longer than "
          f"train.sft_max_len={longest - 1}") in caplog.text
  assert len(warm_start.sft_examples(tasks, tok, 16, max_len=longest)) == 16


class _AnswerBook(scripted_policy.ScriptedDecoder):
  """Answers each prompt from a book (prompt text -> action text); a
  `Decoder` the native engine builds in place of its `Generator`."""

  book: dict[str, str] = {}
  tok = None
  seen_sampling: list[SamplingParams] = []

  def __init__(self, config, params, batch, max_len, sampling, *args):
    del config, params, max_len, args
    _AnswerBook.seen_sampling.append(sampling)
    super().__init__(lambda prompt: self.tok.encode(
        self.book[self.tok.decode(prompt)]), batch)


@pytest.mark.parametrize("reward", ["exact", "score"])
def test_held_out_accuracy_is_full_credit_as_training_reward_exact(
    tok, monkeypatch, reward):
  config = _config("reasoning_gym", "chain_sum", CHAIN_SUM, reward=reward)
  _, held_out = env_build.build_tasks(config.env)
  n = len(held_out)
  env = env_build.make_envs(config.env, held_out, 1)[0]
  book, right = {}, 0
  for i in range(n):
    answer = held_out.entry(i)["answer"]
    # Right answers in formats the scorer accepts, and a wrong one that
    # contains the right one (reasoning-gym's partial credit).
    action = {0: answer, 1: f" {answer} ", 2: answer + "1"}[i % 3]
    right += i % 3 != 2
    book[env.reset(i)] = tok_lib.format_assistant_turn(action)
  _AnswerBook.book, _AnswerBook.tok = book, tok
  monkeypatch.setattr(engine_lib, "Generator", _AnswerBook)
  # Three episodes in flight over the n problems (slots refilled).
  result = eval_lib.evaluate(None, None, config, tok, held_out, batch_size=3)
  assert _AnswerBook.seen_sampling[-1].greedy
  assert result["eval/accuracy"] == pytest.approx(right / n)
  assert result["eval/num_problems"] == n
  # The training side: the sampler's envs and limits.
  envs = env_build.make_envs(config.env, held_out, n)
  trajs = interface.run_episodes(engine_lib.NativeRollout(
      interface.RolloutSettings(
          interface.EngineOptions(num_slots=n),
          rollout.RolloutLimits.from_config(config)),
      model_config=None, tokenizer=tok, envs=envs, weights=lambda: ({}, 0),
      stats=SamplerStats(), rng=jax.random.PRNGKey(0)), range(n))
  rewards = np.array([t.total_reward for t in trajs])
  if reward == "exact":  # Scored exactly as the held-out set.
    assert rewards.mean() == result["eval/accuracy"]
    assert set(rewards) == {0.0, 1.0}
  else:  # Partial credit len(oracle)/len(answer) for the wrong answers.
    wrong = np.arange(n) % 3 == 2
    partial = [len(held_out.entry(i)["answer"]) /
               (len(held_out.entry(i)["answer"]) + 1)
               for i in np.flatnonzero(wrong)]
    np.testing.assert_allclose(rewards[wrong], partial)
    assert (rewards[~wrong] == 1.0).all()


@pytest.mark.parametrize("env_name", ["reasoning_gym", "tool"])
def test_reward_rules_on_partial_credit(env_name):
  config = _config(env_name, "chain_sum", CHAIN_SUM)
  tasks, _ = env_build.build_tasks(config.env)
  i = next(i for i in range(len(tasks)) if tasks.entry(i)["answer"] == "7")
  got = {}
  for rule in rg_env.REWARD_RULES:
    env = env_build.make_envs(config.env, tasks, 1, reward=rule)[0]
    for answer in ("7", "-7", "17", "8"):
      env.reset(i)
      got[rule, answer] = env.step(answer + tok_lib.END).reward
  assert got == {("exact", "7"): 1.0, ("exact", "-7"): 0.0,
                 ("exact", "17"): 0.0, ("exact", "8"): 0.0,
                 ("score", "7"): 1.0, ("score", "-7"): 0.5,
                 ("score", "17"): 0.5, ("score", "8"): 0.0}
  with pytest.raises(ValueError, match="env.reward"):
    rg_env.ReasoningGymEnv(tasks, reward="partial")


def test_sampled_episode_is_on_policy_in_the_train_step(tok):
  config = _config("reasoning_gym", "chain_sum", CHAIN_SUM)
  tasks, _ = env_build.build_tasks(config.env)
  mcfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32,
                     intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, head_dim=16)
  x = jnp.zeros((1, 1), jnp.int32)
  params = nn.unbox(transformer.Transformer(mcfg).init(
      jax.random.PRNGKey(0), x, x, x == 0)["params"])
  temperature, n, seq_len = 0.8, 4, 96
  limits = rollout.RolloutLimits(1, 80, 6)
  envs = env_build.make_envs(config.env, tasks, n)
  engine = engine_lib.NativeRollout(
      interface.RolloutSettings(
          interface.EngineOptions(num_slots=n),
          limits, SamplingParams(temperature=temperature),
          stop_ids=tuple(range(4, tok.vocab_size, 3))),
      model_config=mcfg, tokenizer=tok, envs=envs,
      weights=lambda: (params, 3), stats=SamplerStats(),
      rng=jax.random.PRNGKey(2))
  trajs = interface.run_episodes(engine, range(n))
  # A stopped episode earns a reward (here: force one so it is nonzero).
  for t in trajs:
    t.rewards[np.flatnonzero(t.action_mask)[-1]] += 1.0
  pad = stream_lib.PadToLength(seq_len, stream_lib.StreamCounters(),
                               pad_id=tok.pad_id)
  rows = [pad.map((t, 0)) for t in trajs]
  batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
  mask = np.asarray(batch["action_mask"]).astype(bool)
  assert mask.sum() >= n
  for i, t in enumerate(trajs):  # Reward on each row's last action token.
    last = np.flatnonzero(mask[i])[-1]
    assert float(batch["rewards"][i].sum()) == float(batch["rewards"][i, last])
    assert last == t.length - 1
  value = transformer.value_params_from_policy(params, mcfg,
                                               jax.random.PRNGKey(1))
  tx = optax.sgd(0.0)
  state = step_lib.create_train_state(params, value, tx, tx)
  cfg = step_lib.StepConfig(loss="sao", temperature=temperature)
  values = step_lib._aligned_values(transformer.ValueModel(mcfg), value, batch)
  adv, _, _ = step_lib.compute_advantages(cfg, batch, values, None)
  adv = np.asarray(adv)
  assert (adv[~mask] == 0).all() and (adv[mask] != 0).all()
  fn = step_lib.make_step(mcfg, cfg, tx, tx, update_policy=True)
  _, m = fn(state, batch)
  assert float(m["policy/accept_frac"]) == 1.0
  assert float(m["policy/ratio_min"]) == pytest.approx(1.0, abs=1e-4)
  assert float(m["policy/ratio_max"]) == pytest.approx(1.0, abs=1e-4)


def test_unknown_reward_rule_is_refused_by_the_config_check():
  config = chain_sum.get_config()
  config_validation.validate_config(config)
  config.env.reward = "partial"
  with pytest.raises(config_validation.ConfigError, match="env.reward"):
    config_validation.validate_config(config)
