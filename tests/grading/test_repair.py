"""Repository repair graded by the package's own tests (issue 39 items 2 and
4; docs/design/grading.md "Repository repair"): over many seeds the kept
bugs break a test, the reference scores 1 and the buggy tree 0; every way
of gaming the grader scores 0 and leaves nothing behind, with the vetting
and, for the sandbox-side defences, without it."""

import json

import pytest
import sandbox_pools

from sao_jax.grading import mutations
from sao_jax.grading import repair

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def grader():
  try:
    for name in repair.WORKSPACES:
      repair.workspace(name)
  except repair.WorkspaceMissing as e:
    pytest.skip(str(e))
  g = repair.RepairGrader(sandbox_pools.grading_pool(wall_s=4.0))
  yield g
  g.pool.close()


@pytest.fixture(scope="module")
def task(grader):
  """colorsys's first kept bug from seed 1 on (with CPython 3.11.7's
  colorsys, seed 1: `(maxc - b) / rangec` made `* rangec`)."""
  for seed in range(1, 20):
    t = grader.task("colorsys", seed)
    if t is not None:
      return t
  raise AssertionError("no colorsys bug kept in seeds 1-19")


def test_kept_bugs_break_tests_reference_1_buggy_0(grader):
  """Seeds 0-5 of each workspace: a kept bug fails >= 1 test that passes
  on the reference; the reference scores 1, the buggy tree 0; some bugs
  break no test and are dropped."""
  kept, dropped = [], []
  for name in sorted(repair.WORKSPACES):
    passing = grader.reference_passing(repair.workspace(name))
    assert len(passing) >= 7, (name, passing)
    for seed in range(6):
      t = grader.task(name, seed)
      if t is None:
        dropped.append((name, seed))
        continue
      kept.append((name, seed))
      assert t.broken and set(t.broken) <= set(t.passing), t.broken
      assert t.buggy.sources != t.reference
      assert grader.grade(t, t.reference).passed, (name, seed)
      bad = grader.grade(t, {})
      assert not bad.passed and "the bug broke" in bad.why, (name, seed, bad)
  assert len(kept) >= 9 and dropped, (kept, dropped)  # Here: 13 and 5.
  # A dropped seed did mutate the module: its bug broke no test.
  name, seed = dropped[0]
  assert mutations.mutate(repair.workspace(name).sources[
      repair.WORKSPACES[name][0]], seed) is not None


def test_the_tree_is_the_tasks_tests_and_only_its_sources(grader, task):
  path, = task.buggy.sources
  edits = {path: task.reference[path], "test_colorsys.py": "",
           "unittest.py": "raise SystemExit\n", "../x.py": "y = 1\n"}
  tree = grader.tree(task, edits)
  assert set(tree) == {path, "test_colorsys.py"}
  assert tree["test_colorsys.py"] == task.buggy.tests["test_colorsys.py"]
  assert grader.grade(task, edits).passed
  info = repair.task_info(task)
  assert info["broken"] == len(task.broken) and "reference" not in info


def _attacks(task):
  """name -> the policy's edits, each on top of the buggy source."""
  path, = task.buggy.sources
  buggy = task.buggy.sources[path]
  ids = list(task.passing)
  forged = "".join(json.dumps([t, "pass", ""]) + "\n" for t in ids)
  forged += json.dumps(["<done>", "done", ""]) + "\n"
  tail = {
      "sys_exit": "import sys\nsys.exit(0)\n",
      "os_exit": "import os\nos._exit(0)\n",
      "fake_pass_lines": ("print('OK')\nprint('Ran 9 tests', 'OK')\n"
                          "print('{\"results\": {}, \"done\": true}')\n"),
      "patch_unittest": (
          "import unittest\n"
          "for _n in dir(unittest.TestCase):\n"
          "  if _n.startswith('assert'):\n"
          "    setattr(unittest.TestCase, _n, lambda *a, **k: None)\n"),
      "patch_result": (
          "import unittest\n"
          "unittest.TestResult.addFailure = unittest.TestResult.addSuccess\n"
          "_run = unittest.TestCase.run\n"
          "def _quiet(self, result=None):\n"
          "  try:\n    self._outcome = None\n  finally:\n"
          "    result.addSuccess(self)\n"
          "unittest.TestCase.run = _quiet\n"),
      "forge_report": (
          "import os\n"
          f"_lines = {forged!r}.encode()\n"
          "for _fd in range(3, 64):\n"
          "  try:\n    os.write(_fd, _lines)\n  except OSError:\n    pass\n"
          "os._exit(0)\n"),
      "break_collection": "raise ImportError('no collection today')\n",
      "syntax_error": "def broken(:\n",
      "hang": "while True:\n  pass\n",
      "fork_away": ("import os, time\n"
                    "if os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\n"),
      "read_the_reference": (
          "import sysconfig\n"
          "exec(open(sysconfig.get_paths()['stdlib'] + '/" + path + "')"
          ".read())\n"),
      "always_equal": (
          "class _Eq(float):\n"
          "  def __eq__(self, o):\n    return True\n"
          "  def __ne__(self, o):\n    return False\n"
          "_hsv = hsv_to_rgb\n"
          "def hsv_to_rgb(h, s, v):\n"
          "  return tuple(_Eq(x) for x in _hsv(h, s, v))\n"),
      "patch_checker": (
          "import sys\n"
          "_main = sys.modules['__main__']\n"
          "_main.SPEC['deadline_s'] = 0\n"),
  }
  out = {name: {path: buggy + "\n" + text} for name, text in tail.items()}
  # What the importer reads differs from the text: a utf-7 declaration.
  out["coding_cookie"] = {path: "# -*- coding: utf-7 -*-\n" + buggy +
                          "\n#+AAo-import os+AAo-os._exit(0)\n"}
  out["edit_tests"] = {"test_colorsys.py": "import unittest\n"}
  out["delete_tests"] = {path: buggy, "test_colorsys.py": None}
  return out


# Scored 0 by the sandbox side alone (vetting off): the runner's exit,
# prints, blanket patches, forged reports, broken collection, hangs and
# forks. The others (reading the reference on the sandbox's disk, an
# always-equal value, targeted patches through the runner's memory) need
# the vetting.
_SANDBOX_SIDE = ("sys_exit", "os_exit", "fake_pass_lines", "patch_unittest",
                 "patch_result", "forge_report", "break_collection",
                 "syntax_error", "hang", "fork_away", "edit_tests",
                 "delete_tests")


def test_attacks_score_0_and_leave_nothing(grader, task):
  attacks = _attacks(task)
  for name, edits in sorted(attacks.items()):
    grade = grader.grade(task, edits)
    assert not grade.passed, (name, grade)
    if name not in _SANDBOX_SIDE:
      assert grade.why.startswith("refused:"), (name, grade)
  assert grader.pool.leftovers() in (None, [])  # None: counted as root.
  assert grader.grade(task, task.reference).passed  # Nothing left behind.


def test_the_sandbox_side_holds_without_the_vetting(grader, task):
  bare = repair.RepairGrader(grader.pool, vet=False)
  attacks = _attacks(task)
  whys = {}
  for name in _SANDBOX_SIDE:
    grade = bare.grade(task, attacks[name])
    assert not grade.passed, (name, grade)
    whys[name] = grade.why
  for name in ("patch_unittest", "patch_result", "forge_report"):
    assert "canary" in whys[name], whys  # Everything passed, canaries too.
  assert "did not finish in time" in whys["hang"], whys
  assert "ended before it finished" in whys["os_exit"], whys
  assert grader.pool.leftovers() in (None, [])
  # What the vetting is for: without it the reference on the sandbox's disk
  # repairs the tree, and an always-equal value passes assertAlmostEqual.
  assert bare.grade(task, attacks["read_the_reference"]).passed
  assert bare.grade(task, attacks["always_equal"]).passed
  assert bare.grade(task, task.reference).passed
