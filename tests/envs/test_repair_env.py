"""The repair environment (`env.name = 'repair'`, issue 39 item 2): tools on
a per-episode workspace, the visible tests, the grade on submission, the
config's tasks with disjoint splits."""

import json

import pytest
import sandbox_pools

from sao_jax.envs import build
from sao_jax.envs import demonstrations
from sao_jax.envs import function_tasks
from sao_jax.envs import repair_env
from sao_jax.grading import functions
from sao_jax.grading import repair
from sao_jax.tokenization.chat_template import SAO_MARKUP

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def pool():
  p = sandbox_pools.grading_pool(wall_s=4.0)
  yield p
  p.close()


def _call(name, **arguments):
  return SAO_MARKUP.format_tool_call(json.dumps({"name": name,
                                                 "arguments": arguments}))


def _result(step):
  text = step.observation
  return text[text.index(SAO_MARKUP.result_prefix) +
              len(SAO_MARKUP.result_prefix):text.rindex(
                  SAO_MARKUP.result_suffix)]


def test_an_episode_reads_runs_fixes_and_is_graded(pool):
  tasks = repair_env.RepairTasks(repair.RepairGrader(pool), ["ledger"], 2,
                                 first_seed=1)  # Seed 0's bug hangs.
  env = repair_env.RepairEnv(tasks, max_tool_calls=11)
  prompt = env.reset(0)
  task = tasks.task(0)
  path = task.path
  assert path in prompt and "test_ledger.py" in prompt
  assert _result(env.step(_call("read_file", path=path))).startswith(
      task.buggy.sources[path][:40].strip())
  lines = task.buggy.sources[path].splitlines(keepends=True)
  assert _result(env.step(_call("read_file", path=path, start=3, end=5))
                 ).strip() == "".join(lines[2:5]).strip()
  before = _result(env.step(_call("run_tests")))
  assert f"{len(task.broken)} failed" in before, before
  assert task.broken[0] in before
  # Mistakes are observations, not episode ends.
  for bad, want in ((_call("read_file", path="../etc/passwd"), "error:"),
                    (_call("str_replace", path=path, old="", new="x"),
                     "error:"),
                    (SAO_MARKUP.format_tool_call("not json"), "error:"),
                    (_call("write_file", path="test_ledger.py",
                           content="import os\nprint(open('x').read())\n"),
                     "wrote")):
    step = env.step(bad)
    assert not step.done and _result(step).startswith(want), _result(step)
  assert _result(env.step(_call("run_tests"))).startswith("refused:")
  env.step(_call("write_file", path="test_ledger.py",
                 content=task.buggy.tests["test_ledger.py"]))
  env.step(_call("write_file", path=path, content=task.reference[path]))
  after = _result(env.step(_call("run_tests")))
  assert after.startswith(f"{len(task.passing)} passed, 0 failed"), after
  final = env.step(SAO_MARKUP.format_assistant_turn("Fixed."))
  assert final.done and final.reward == 1.0, final.info
  assert env.workspace is None  # The workspace ended with the episode.
  # The next episode of the same task starts from the buggy tree again.
  env.reset(0)
  assert env.workspace == task.buggy.files()
  over = [env.step(_call("read_file", path=path)) for _ in range(12)][-1]
  assert "more than 11 tool calls" in _result(over)
  final = env.step(SAO_MARKUP.format_assistant_turn("Done."))
  assert final.done and final.reward == 0.0
  assert "the bug broke" in final.info["repair_why"]


def test_an_edited_test_file_does_not_reach_the_grade(pool):
  tasks = repair_env.RepairTasks(repair.RepairGrader(pool), ["ledger"], 1,
                                 first_seed=1)
  env = repair_env.RepairEnv(tasks)
  env.reset(0)
  env.step(_call("write_file", path="test_ledger.py",
                 content="import unittest\n"))
  assert _result(env.step(_call("run_tests"))).startswith("0 passed")
  assert env.step(SAO_MARKUP.format_assistant_turn("ok")).reward == 0.0


def test_repair_tasks_from_the_config(pool, monkeypatch):
  from configs import base  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(function_tasks._GRADERS, ("bwrap", 1),  # pylint: disable=protected-access
                      functions.FunctionGrader(pool))
  cfg = base.get_config()
  cfg.env.name, cfg.env.code_sandbox, cfg.env.code_workers = (
      "repair", "bwrap", 1)
  cfg.env.size, cfg.env.eval_size = 3, 1
  cfg.env.seed = 1  # Seed 0's bug hangs the tests (3 s to find out).
  cfg.env.dataset_config = {"workspaces": ["ledger"]}
  train, held = build.build_tasks(cfg.env)
  assert (len(train), len(held)) == (3, 1)
  seeds = [train.task(i).seed for i in range(3)]
  assert all(s % 10 != 9 for s in seeds) and held.task(0).seed % 10 == 9
  assert [train.task(i).name for i in range(3)] == ["ledger"] * 3
  assert len(set(seeds)) == 3 and train.task(2) is train.task(2)
  assert sorted({train.seed(k) for k in range(40)}) == [
      s for s in range(50) if s % 10 != 9][:40]
  assert [held.seed(k) for k in range(3)] == [9, 19, 29]
  env = build.make_envs(cfg.env, train, 1)[0]
  assert isinstance(env, repair_env.RepairEnv) and env.max_tool_calls == 4
  assert "ledger/book.py" in env.reset(0)
  assert train.observation_chars == cfg.env.code_observation_chars == 512
  with pytest.raises(ValueError, match="workspaces"):
    repair_env.RepairTasks(train.grader, ["numpy"], 1)


class _CharTokenizer:
  """Just enough of a TextTokenizer for `demonstration`: one id per char."""

  def __init__(self, template):
    self.template = template

  def encode(self, text):
    return [ord(c) for c in text]


def test_bug_hunk_is_one_unique_replacement():
  buggy = "a = 1\nb = 2\nx = 0\nc = 3\nx = 0\n"
  fixed = "a = 1\nb = 2\nx = 1\nc = 3\nx = 0\n"
  # 'x = 0' occurs twice: grown to the lines around it.
  assert repair_env.bug_hunk(buggy, fixed) == (
      2, 4, "b = 2\nx = 0\nc = 3\n", "b = 2\nx = 1\nc = 3\n")
  # A removed statement: the buggy side is empty until grown.
  first, last, old, new = repair_env.bug_hunk(
      "a = 1\nc = 3\n", "a = 1\nb = 2\nc = 3\n")
  assert (old, new) == ("a = 1\nc = 3\n", "a = 1\nb = 2\nc = 3\n")
  assert (first, last) == (1, 2)


def test_demonstrations_replay_through_the_env_and_score_1(pool):
  """SFT shows the policy what RL will see: the env's own observations for
  the demonstration's calls, and the reference fix is graded 1."""
  tasks = repair_env.RepairTasks(repair.RepairGrader(pool), ["ledger"], 3,
                                 first_seed=1, observation_chars=300)
  env = repair_env.RepairEnv(tasks, observation_chars=300,
                             instruction=" Be brief.")
  env.set_template(SAO_MARKUP)
  decode = lambda ids: "".join(map(chr, ids))
  for i in range(len(tasks)):
    entry = tasks.entry(i)
    assert tasks.entry(i) is entry  # Made once.
    segments = demonstrations.demonstration(
        entry, i, _CharTokenizer(SAO_MARKUP), instruction=" Be brief.")
    assert [t for _, t in segments] == [False, True, False, True, False,
                                        True, False, True]
    assert env.reset(i) == decode(segments[0][0])
    names = []
    for (call, _), (result, _) in zip(segments[1:-1:2], segments[2:-1:2]):
      step = env.step(decode(call))
      assert step.observation == decode(result) and not step.done
      names.append(json.loads(step.info["tool_call"])["name"])
    assert names == ["run_tests", "read_file", "str_replace"]
    assert "failed" in entry["tool_calls"][0][1]
    task = tasks.task(i)
    assert env.workspace[task.path] == task.reference[task.path]
    final = env.step(decode(segments[-1][0]))
    assert final.done and final.reward == 1.0, final.info
