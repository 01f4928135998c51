"""Function tasks judged by hidden tests (issue 39 items 1 and 4;
docs/design/grading.md): the splits, the references score 1 and empty
answers 0 over many tasks, and every way of gaming the grader scores 0 and
leaves nothing behind."""

import json
import random

import pytest
import sandbox_pools

from sao_jax.envs import build
from sao_jax.envs import function_tasks
from sao_jax.grading import functions
from sao_jax.grading import values

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def grader():
  g = functions.FunctionGrader(sandbox_pools.grading_pool())
  yield g
  g.pool.close()


def _valid(grader, tasks, n, seed=0):
  """`n` tasks of `tasks` (seeded draw) that have hidden tests."""
  out = []
  for task in random.Random(seed).sample(tasks, len(tasks)):
    if grader.hidden_tests(task) is not None:
      out.append(task)
      if len(out) == n:
        return out
  raise AssertionError(f"fewer than {n} valid tasks")


def test_values_compare_as_json_on_the_host():
  assert values.same({"a": [1, 2.0, "x"]}, {"a": [1, 2.0000001, "x"]})
  assert values.same(float("nan"), float("nan"))
  assert not values.same(1, True) and not values.same(True, 1)
  assert not values.same([1, 2], [1, 2, 3])
  assert not values.same({"a": 1}, {"a": 1, "b": 2})
  assert not values.same(1.0, 1.01) and not values.same("1", 1)
  assert values.same(3, 3.0000000001) and not values.same(3, 4)


def test_code_is_the_last_fenced_block():
  reply = "Plan:\n```python\nx = 1\n```\nthen\n```python\ndef f(): pass\n```"
  assert functions.code_of(reply) == "def f(): pass\n"
  assert functions.code_of("def f(): pass") == "def f(): pass"
  assert functions.code_of("```\ny = 2\n```") == "y = 2\n"


def test_splits_are_stable_disjoint_and_from_the_standard_library():
  train, held = function_tasks.split("train"), function_tasks.split("heldout")
  assert len(train) > 1500 and 150 < len(held) < 300
  assert not {t.key for t in train} & {t.key for t in held}
  assert all(int(t.key, 16) % function_tasks.HELDOUT_EVERY == 0 for t in held)
  first = held[0]
  assert function_tasks.task_from_row({
      "task_description": first.description, "input_output_spec": first.spec,
      "code_sample": first.reference,
      "input_generator": first.generator}) == first
  assert function_tasks.task_from_row({
      "task_description": "x", "input_output_spec": "y",
      "code_sample": "import numpy\ndef main_solution(a): return a",
      "input_generator": "def generate_inputs(rng): return {}"}) is None


@pytest.mark.parametrize("nested", [
    "def main_solution(a):\n  import numpy\n  return a",
    "class C:\n  if True:\n    from numpy import linalg",
    "try:\n  pass\nexcept Exception:\n  import numpy.linalg",
    "for i in []:\n  pass\nelse:\n  with open('x'):\n    import numpy",
    "try:\n  pass\nfinally:\n  while False:\n    import numpy",
    "match 1:\n  case 1:\n    import numpy",
])
def test_an_import_anywhere_outside_the_standard_library_is_no_task(nested):
  row = {"task_description": "x", "input_output_spec": "y",
         "code_sample": "def main_solution(a):\n  return a\n",
         "input_generator": "def generate_inputs(rng):\n  return {}\n"}
  assert function_tasks.task_from_row(row) is not None
  assert function_tasks.task_from_row(
      {**row, "code_sample": row["code_sample"] + nested}) is None
  assert function_tasks.task_from_row(
      {**row, "input_generator": row["input_generator"] + nested}) is None


def test_references_score_1_and_empty_answers_0(grader):
  """Over 30 tasks of each split: the reference passes every hidden test;
  an answer returning None, and one that is not code, pass none."""
  for name in ("train", "heldout"):
    for task in _valid(grader, function_tasks.split(name), 30, seed=1):
      assert grader.grade(task.reference, task).fraction == 1.0, task.key
      none = grader.grade("def main_solution(*a, **k):\n  return None\n", task)
      assert none.passed < none.total, task.key
      assert grader.grade("I don't know.", task).passed == 0, task.key


# Ways to game the grader. Each must score 0 on every task and leave nothing.
ATTACKS = {
    "sys_exit": "import sys\nsys.exit(0)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "exit_in_call": ("def main_solution(**k):\n  import sys\n  sys.exit(0)\n"),
    "fake_pass_line": ("print('8 passed, 0 failed')\nprint('{\"outputs\": []}')"
                       "\ndef main_solution(**k):\n  print('PASS')\n"),
    "always_equal": ("class Eq:\n  def __eq__(self, o): return True\n"
                     "  def __ne__(self, o): return False\n"
                     "def main_solution(**k):\n  return Eq()\n"),
    "patch_json": ("import json\njson.dumps = lambda *a, **k: '0'\n"
                   "def main_solution(**k):\n  return 0\n"),
    "fake_channel": ("import os, json\n"
                     "os.write(3, json.dumps({'outputs': ['0'] * 8}).encode())\n"
                     "os._exit(0)\n"),
    "echo_inputs": "def main_solution(**k):\n  return k\n",
    "read_task_data": (
        "import glob, gzip, json\n"
        "rows = []\n"
        "for p in glob.glob('/**/codeio.jsonl.gz', recursive=True):\n"
        "  rows += [json.loads(l) for l in gzip.open(p, 'rt')]\n"
        "try:\n"
        "  import reasoning_gym\n"
        "  rows.append('imported')\n"
        "except ImportError:\n"
        "  pass\n"
        "def main_solution(**k):\n  return len(rows)\n"),
    "hang": "while True:\n  pass\n",
    "fork_away": ("import os, time\n"
                  "if os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\n"
                  "def main_solution(**k):\n  return None\n"),
    "broken_source": "def main_solution(:\n",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_gaming_the_grader_scores_0_and_leaves_nothing(grader, attack):
  for task in _valid(grader, function_tasks.split("train"), 3, seed=2):
    grade = grader.grade(ATTACKS[attack], task)
    assert grade.passed == 0 and grade.fraction == 0.0, (attack, grade)
  left = grader.pool.leftovers()
  assert left in (None, []), left  # None: counted only as root.


def test_a_fake_channel_write_is_not_read_as_a_pass(grader):
  """The harness's channel is writable by the candidate (it shares the
  process); what matters is that only the expected values pass, and those
  never enter the sandbox: a candidate that writes them would need them."""
  task = _valid(grader, function_tasks.split("train"), 1, seed=3)[0]
  tests = grader.hidden_tests(task)
  honest = [json.dumps(v, sort_keys=True) for v in tests.expected]
  forged = ("import os, json\n"
            f"os.write(3, json.dumps({{'outputs': {honest!r}}}).encode())\n"
            "os._exit(0)\n")
  # With the expected values (which only the host has) the forgery passes:
  # the channel is not the defence, the values' absence is.
  assert grader.grade(forged, task).fraction == 1.0
  harness = functions.harness({"mode": "candidate", "source": "x = 1",
                               "entry": task.entry, "inputs": tests.inputs})
  assert all(json.dumps(v) not in harness for v in tests.expected
             if json.dumps(v) not in json.dumps(tests.inputs))


def test_the_grading_sandbox_sees_no_venv(grader):
  r = grader.pool.run(
      "import sys, os\ntry:\n  import reasoning_gym\n  print('rg')\n"
      "except ImportError:\n  print('none')\n"
      f"print(os.path.exists({function_tasks._data_path()!r}))")  # pylint: disable=protected-access
  assert r.stdout.split() == ["none", "False"], r


def test_codeio_tasks_from_the_config(grader, monkeypatch):
  """`env.dataset = 'codeio'`: the env's training and held-out tasks, each
  task's prompt and demonstration, and its reward."""
  from configs import base  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(function_tasks._GRADERS, ("bwrap", 1), grader)  # pylint: disable=protected-access
  cfg = base.get_config()
  cfg.env.dataset = "codeio"
  cfg.env.code_sandbox = "bwrap"
  cfg.env.code_workers = 1
  cfg.env.size, cfg.env.eval_size = 50, 8
  train, held = build.build_tasks(cfg.env)
  assert (len(train), len(held)) == (50, 8)
  assert not ({train.task(i).key for i in range(5)}
              & {held.task(i).key for i in range(8)})
  entry = train.entry(0)
  task = train.task(0)
  assert task.description in entry["question"]
  assert f"main_solution({', '.join(task.params)})" in entry["question"]
  assert train.score(entry["answer"], 0) == 1.0
  assert train.score("```python\ndef main_solution(**k): return 0\n```",
                     0) < 1.0
  assert train.prompt_id(0) == int(task.key[:7], 16) < 2**31  # int32 rows.


def test_multi_turn_run_test_then_answer(grader, monkeypatch):
  """`env.name = 'code'` on codeio: the policy runs its code with the Python
  tool (a sandbox without the venv either), reads the result, then answers;
  the answer alone is graded."""
  from configs import base  # pylint: disable=import-outside-toplevel
  from sao_jax.envs.base import SAO_MARKUP  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(function_tasks._GRADERS, ("bwrap", 1), grader)  # pylint: disable=protected-access
  cfg = base.get_config()
  cfg.env.name, cfg.env.dataset = "code", "codeio"
  cfg.env.code_sandbox, cfg.env.code_workers = "bwrap", 1
  cfg.env.size, cfg.env.eval_size = 4, 4
  train, _ = build.build_tasks(cfg.env)
  env = build.make_envs(cfg.env, train, 1)[0]
  env.set_template(SAO_MARKUP)
  env.reset(0)
  task = train.task(0)
  probe_code = ("try:\n  import reasoning_gym\n  print('rg')\n"
                "except ImportError:\n  print('no venv')\n"
                + task.reference + "\nprint('ran')")
  step = env.step(SAO_MARKUP.format_tool_call(probe_code))
  assert not step.done and step.reward == 0.0
  assert "no venv" in step.observation and "ran" in step.observation
  final = env.step(SAO_MARKUP.format_assistant_turn(
      function_tasks.demonstration(task)))
  assert final.done and final.reward == 1.0
  env.reset(1)
  assert env.step(SAO_MARKUP.format_assistant_turn(
      "```python\ndef main_solution(**k): return None\n```")).reward == 0.0


def test_reference_length_is_a_difficulty_knob():
  short = function_tasks.split("train", max_reference_chars=600)
  assert 0 < len(short) < len(function_tasks.split("train"))
  assert all(len(t.reference) <= 600 for t in short)
  assert {t.key for t in short} <= {t.key for t in function_tasks.split("train")}
