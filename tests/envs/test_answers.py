"""Answer extraction for instruct models, and that reward and eval share it."""

import pytest

from sao_jax.envs import answers
from sao_jax.envs import build as env_build
from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import tool_env
import ml_collections


@pytest.mark.parametrize("reply, want", [
    ("The answer to this problem is 19.", "19"),
    ("3 + 4 = 7", "7"),
    ("It is -12", "-12"),
    ("Half is 3.5.", "3.5"),
    ("Total: 1,024 apples", "1024"),
    ("First 2, then 10, finally 4", "4"),
    ("no digits here", ""),
    ("", ""),
])
def test_last_number(reply, want):
  assert answers.extract(reply, "last_number") == want


def test_answer_tag_and_fallback():
  reply = "Try <answer>5</answer>... no: <answer> 6 </answer> then 99"
  assert answers.extract(reply, "answer_tag") == "6"
  assert answers.extract(reply, "answer_tag_or_last_number") == "6"
  assert answers.extract("It is 8.", "answer_tag") == ""
  assert answers.extract("It is 8.", "answer_tag_or_last_number") == "8"
  assert answers.extract(" 8 is it", "whole") == " 8 is it"


def test_unknown_rule_is_rejected_with_the_choices():
  with pytest.raises(ValueError, match="last_number"):
    answers.extract("1", "first_number")
  tasks = reasoning_gym_env.ReasoningGymTasks("chain_sum", None, seed=0, size=1)
  with pytest.raises(ValueError, match="config.env.answer"):
    reasoning_gym_env.ReasoningGymEnv(tasks, answer="nope")


@pytest.mark.parametrize("name", ["reasoning_gym", "tool"])
def test_env_scores_the_extracted_answer_with_reasoning_gym(name):
  """A chatty reply scores 1 under last_number, ~0 under whole; the envs the
  sampler and the held-out evaluation build (make_envs) use the rule."""
  cfg = ml_collections.ConfigDict(dict(
      name=name, dataset="chain_sum",
      dataset_config={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                      "max_digits": 1},
      seed=0, size=4, eval_seed=100, eval_size=4, max_tool_calls=2,
      instruction="", answer="last_number"))
  train, held_out = env_build.build_tasks(cfg)
  for tasks in (train, held_out):
    entry = tasks.entry(1)
    chatty = f"The answer to this problem is {entry['answer']}.<|end|>"
    env = env_build.make_envs(cfg, tasks, 1)[0]
    env.reset(1)
    _, reward, done, info = env.step(chatty)
    assert done and reward == 1.0 and info["answer"] == str(entry["answer"])
    whole = tool_env.ToolEnv(tasks) if name == "tool" else (
        reasoning_gym_env.ReasoningGymEnv(tasks))
    whole.reset(1)
    assert whole.step(chatty).reward < 0.1  # reasoning-gym: partial credit.
