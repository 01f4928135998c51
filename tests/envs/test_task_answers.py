"""Answers that are not numbers are scored by the task's own scorer (issue 18).

Words, yes/no, lists and grids get their reward from reasoning-gym's own
``score_answer`` on the extracted answer, as numbers do: the SFT
demonstration, replayed as an episode, earns full reward; another problem's
answer earns what the task's scorer says (0 under 'exact' unless it gives
full credit). Held-out accuracy scores with the same environments
(``train.evaluate`` builds them with ``envs.build.make_envs``, reward
'exact'), so demonstrations, training reward and held-out scorer agree on
every task.
"""

import pytest

from configs import reasoning_gym
import scripted_policy
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import build as env_build
from sao_jax.envs import demonstrations
from sao_jax.envs import reasoning_gym_env as rg_env
from sao_jax.envs import task_sizing
from sao_jax.sampler import rollout

# (dataset, what its answers look like).
ANSWER_KINDS = [
    ("spell_backward", "a word"),
    ("syllogism", "Yes / No"),
    ("word_sequence_reversal", "a list of words"),
    ("number_sorting", "a list of numbers"),
    ("rotate_matrix", "a grid"),
    ("letter_counting", "a number"),
]


def _task_config(dataset: str, size: int = 32):
  config = reasoning_gym.get_config()
  config.env.dataset = dataset
  config.env.size, config.env.eval_size = size, 8
  config.tokenizer.corpus_size = 100
  return config


@pytest.mark.parametrize("dataset,kind", ANSWER_KINDS)
def test_demonstrated_answer_earns_full_reward(tmp_path, dataset, kind):
  del kind  # For the test id's reader.
  config = _task_config(dataset)
  tok = tok_lib.tokenizer_from_config(config.tokenizer, tmp_path, config.env)
  tasks = env_build.build_tasks(config.env)
  config = task_sizing.resolve(config, tok, tasks)
  train, _ = tasks
  n = 8
  examples = [demonstrations.demonstration(train.entry(i), i, tok)
              for i in range(n)]
  # The demonstration is the answer reasoning-gym gives, verbatim.
  for i, ex in enumerate(examples):
    assert tok.decode(ex[-1][0]) == tok.template.format_assistant_turn(
        str(train.entry(i)["answer"]))

  def play(scripts):
    envs = env_build.make_envs(config.env, train, n)
    return scripted_policy.play(scripts, envs, range(n), tok,
                                rollout.RolloutLimits.from_config(config))[0]

  right = play([[t for seg, trained in ex if trained for t in seg]
                for ex in examples])
  assert [t.total_reward for t in right] == [1.0] * n
  # Problem i answered with problem i+1's answer: the task's scorer decides.
  wrong = play([list(tok.encode(tok.template.format_assistant_turn(
      str(train.entry((i + 1) % n)["answer"])))) for i in range(n)])
  for i, traj in enumerate(wrong):
    other = str(train.entry((i + 1) % n)["answer"])
    score = train.dataset.score_answer(other, train.entry(i))
    assert traj.total_reward == rg_env.reward_from_score(score, "exact")
  assert sum(t.total_reward for t in wrong) < n
