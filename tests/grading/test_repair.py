"""Repository repair graded by the package's own tests (issue 39 items 2 and
4; docs/design/grading.md "Repository repair"): over many seeds the kept
bugs break a test, the reference scores 1 and the buggy tree 0; every way
of gaming the grader scores 0 and leaves nothing behind, with the vetting
and, for the sandbox-side defences, without it."""

import json
import os
import sysconfig

import pytest
import sandbox_pools

from sao_jax.grading import functions
from sao_jax.grading import mutations
from sao_jax.grading import repair

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def grader():
  """A 4 s wall, for the calls that hang (attacks, hanging bugs)."""
  g = repair.RepairGrader(sandbox_pools.grading_pool(wall_s=4.0))
  yield g
  g.pool.close()


@pytest.fixture(scope="module")
def roomy_grader():
  """Grading's own wall (10 s), for the runs that must finish: a reference
  tree's tests take ~0.05 s quiet, and missed a 3 s deadline at a load of 8+
  (a shared CI machine)."""
  g = repair.RepairGrader(sandbox_pools.grading_pool(
      wall_s=functions.LIMITS.wall_s))
  yield g
  g.pool.close()


def _needs(name):
  try:
    return repair.workspace(name)
  except repair.WorkspaceMissing as e:
    pytest.skip(str(e))


@pytest.fixture(scope="module")
def task(grader):
  """The shipped workspace's first kept bug from seed 1 on (seed 1: in
  ledger/book.py, `totals.get(category, 0) + cents` made `- cents`)."""
  for seed in range(1, 20):
    t = grader.task("ledger", seed)
    if t is not None:
      return t
  raise AssertionError("no ledger bug kept in seeds 1-19")


@pytest.mark.parametrize("name", repair.WORKSPACES)
def test_kept_bugs_break_tests_reference_1_buggy_0(roomy_grader, name):
  """Seeds 0-5: a kept bug fails >= 1 test that passes on the reference;
  the reference scores 1, the buggy tree 0."""
  clean = _needs(name)
  passing = roomy_grader.reference_passing(clean)
  assert len(passing) >= 7, (name, passing)
  kept = 0
  for seed in range(6):
    t = roomy_grader.task(name, seed)
    if t is None:
      continue
    kept += 1
    assert t.broken and set(t.broken) <= set(t.passing), t.broken
    assert t.buggy.sources[t.path] != t.reference[t.path]
    assert sum(t.buggy.sources[p] != clean.sources[p]
               for p in clean.sources) == 1  # One bug, in one file.
    assert roomy_grader.grade(t, t.reference).passed, (name, seed)
    bad = roomy_grader.grade(t, {})
    assert not bad.passed and "the bug broke" in bad.why, (name, seed, bad)
  assert kept >= 3, (name, kept)  # Seeds 0-5 here: 3 to 5 of 6.


@pytest.mark.parametrize("seed,why", [(36, "breaks no test"),
                                       (0, "hangs the tests")])
def test_a_bug_that_breaks_no_test_or_hangs_is_dropped(grader, seed, why):
  """ledger: seed 36's bug passes every test, seed 0's (`1000 >= whole` in
  format_cents' loop) hangs them; neither is a task."""
  clean = repair.workspace("ledger")
  buggy, path, _ = repair.buggy_workspace(clean, seed)
  assert buggy.sources[path] != clean.sources[path]
  run = repair.run_tests(grader.pool, buggy.files(), buggy.test_modules)
  if why == "hangs the tests":  # What `task` sees; seed 0 is also in
    assert not run.done and "in time" in run.why, run  # the test above.
  else:
    assert run.done and set(run.results.values()) == {"pass"}, run
    assert grader.task("ledger", seed) is None


def test_the_tree_is_the_tasks_tests_and_only_its_sources(grader, task):
  path = task.path
  test_file, = task.buggy.tests
  edits = {path: task.reference[path], test_file: "",
           "unittest.py": "raise SystemExit\n", "../x.py": "y = 1\n"}
  tree = grader.tree(task, edits)
  assert set(tree) == set(task.buggy.sources) | {test_file}
  assert tree[test_file] == task.buggy.tests[test_file]
  assert grader.grade(task, edits).passed
  info = repair.task_info(task)
  assert info["broken"] == len(task.broken) and "reference" not in info


def _attacks(task):
  """name -> the policy's edits, each on top of the buggy source."""
  path = task.path
  buggy = task.buggy.sources[path]
  test_file, = task.buggy.tests
  ids = list(task.passing)
  forged = "".join(json.dumps([t, "pass", ""]) + "\n" for t in ids)
  forged += json.dumps(["<done>", "done", ""]) + "\n"
  # The reference's text: the stdlib's copy (mounted in the sandbox), or
  # the shipped one's host path (not mounted).
  where = [os.path.join(sysconfig.get_paths()["stdlib"], path),
           os.path.join(repair._SHIPPED_DIR, task.name, path)]  # pylint: disable=protected-access
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
          "def _quiet(self, result=None):\n"
          "  result.addSuccess(self)\n"
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
          f"for _p in {where!r}:\n"
          "  try:\n    exec(open(_p).read())\n    break\n"
          "  except OSError:\n    pass\n"),
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
  out["edit_tests"] = {test_file: "import unittest\n"}
  out["delete_tests"] = {path: buggy, test_file: None}
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
  for name in _SANDBOX_SIDE + ("read_the_reference",):  # Not mounted.
    grade = bare.grade(task, attacks[name])
    assert not grade.passed, (name, grade)
    whys[name] = grade.why
  for name in ("patch_unittest", "patch_result", "forge_report"):
    assert "canary" in whys[name], whys  # Everything passed, canaries too.
  assert "did not finish in time" in whys["hang"], whys
  assert "ended before it finished" in whys["os_exit"], whys
  assert grader.pool.leftovers() in (None, [])
  assert bare.grade(task, task.reference).passed


def test_what_the_vetting_is_for(grader):
  """colorsys: without the vetting, the standard library's copy of the
  reference (which the grading sandbox mounts) repairs the tree, and an
  always-equal value passes assertAlmostEqual; with it both are refused."""
  _needs("colorsys")
  t = next(t for t in (grader.task("colorsys", s) for s in range(1, 20))
           if t is not None)
  bare = repair.RepairGrader(grader.pool, vet=False)
  for name in ("read_the_reference", "always_equal"):
    edits = _attacks(t)[name]
    assert bare.grade(t, edits).passed, name
    assert grader.grade(t, edits).why.startswith("refused:"), name
