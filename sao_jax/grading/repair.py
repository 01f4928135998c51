"""Repository repair judged by its own tests (docs/design/grading.md
"Repository repair").

A workspace is a small real package with its test suite: a pure-Python
module of CPython's standard library and its unittest file from the `test`
package (on Debian: apt package `libpython3.11-testsuite`), or a package
shipped in grading/workspaces/ with its tests. A task is the
workspace with one bug (`mutations.mutate`, picked by the seed) that makes
at least one test fail, both found by running the tests in the sandbox.
The reference source stays on the host.

A candidate (the policy's edits) is graded in one sandbox call of its own
(standard library only) on a clean tree: the task's own test files, and the
policy's text for the module's source files only (edits of tests, and new
files, are dropped). In the call two processes:

- the **checker** (the call's process) writes the tree, forks the runner,
  and reads one JSON line per finished test from a pipe; it never imports
  the tree's code, and it alone holds the channel (a copy of stdout) that
  the host reads;
- the **runner** holds the pipe's write end and /dev/null only; it loads
  the test modules with unittest and runs them with two canary tests of a
  name drawn per grade (one must fail, one must pass).

The host passes the grade only when the runner said it finished, no test
was reported twice, the canaries came out right, and every test that
passes on the reference is reported passing (a collection error, a missing
test or a time-out fails). Before that, `vetting.refusal` refuses edits
that name capabilities (imports, sys, unittest, dunders, frames) anew.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import sysconfig
import threading
from typing import Any

from absl import logging

from sao_jax.grading import mutations
from sao_jax.grading import vetting
from sao_jax.grading.functions import CHANNEL_PREAMBLE
from sao_jax.grading.functions import harness_answer
from sao_jax.sandbox.pool import SandboxPool

# Standard-library workspaces, name -> (the module's file, its test module):
# pure Python, tests that need unittest only (not test.support).
STDLIB = {"textwrap": ("textwrap.py", "test_textwrap"),
          "colorsys": ("colorsys.py", "test_colorsys"),
          "fnmatch": ("fnmatch.py", "test_fnmatch")}
# Packages shipped here (grading/workspaces/NAME: a package and top-level
# test_*.py files, each stored as FILE.py.txt), which need no apt package.
SHIPPED = ("ledger",)
WORKSPACES = (*sorted(STDLIB), *SHIPPED)
_SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "workspaces")
TESTSUITE_APT = "libpython3.11-testsuite"
_DEADLINE_S = 0.75  # Of the call's wall: the checker answers before it.

_HARNESS = CHANNEL_PREAMBLE + r'''
import select, signal, time
_t0 = time.monotonic()
root = os.path.join(os.getcwd(), "ws")
for path, text in SPEC["files"].items():
  full = os.path.join(root, path)
  os.makedirs(os.path.dirname(full), exist_ok=True)
  with open(full, "wb") as f:  # UTF-8, as the host's vetting parsed it.
    f.write(text.encode("utf-8"))
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # The runner: the pipe's write end and /dev/null only.
  for fd in (0, 1, 2):
    os.dup2(_null, fd)
  os.closerange(3, w)
  os.closerange(w + 1, 1 << 16)
  os.chdir(root)
  sys.path.insert(0, root)
  report = os.fdopen(w, "w")

  def put(name, status, detail=""):
    report.write(json.dumps([name, status, detail[-1500:]]) + "\n")
    report.flush()

  import traceback, unittest
  for name in SPEC["evict"]:  # unittest's own imports (fnmatch) aside.
    sys.modules.pop(name, None)

  class Result(unittest.TestResult):
    """One line per test, at its end: its worst outcome (subtests too)."""
    RANK = {"pass": 0, "skip": 1, "fail": 2, "error": 3}
    def __init__(self):
      super().__init__()
      self.now = {}
    def _note(self, test, status, detail=""):
      if not isinstance(test, unittest.TestCase):  # setUpClass & co.
        put(str(test), status, detail)
        return
      old = self.now.get(test.id())
      if old is None or self.RANK[status] > self.RANK[old[0]]:
        self.now[test.id()] = (status, detail)
    def stopTest(self, test):
      super().stopTest(test)
      status, detail = self.now.pop(test.id(), ("error", "no outcome"))
      put(test.id(), status, detail)
    def addSubTest(self, test, sub, err):
      if err is not None:
        self._note(test, "fail", self._exc_info_to_string(err, test))
    def addSuccess(self, test):
      self._note(test, "pass")
    def addFailure(self, test, err):
      self._note(test, "fail", self._exc_info_to_string(err, test))
    def addError(self, test, err):
      self._note(test, "error", self._exc_info_to_string(err, test))
    def addSkip(self, test, reason):
      self._note(test, "skip", reason)
    def addExpectedFailure(self, test, err):
      self._note(test, "pass")
    def addUnexpectedSuccess(self, test):
      self._note(test, "fail", "unexpected success")

  suite = unittest.TestSuite()
  try:
    for name in SPEC["modules"]:
      suite.addTests(unittest.defaultTestLoader.loadTestsFromName(name))
  except BaseException:
    put("<collection>", "error", traceback.format_exc())
  if SPEC.get("canary"):
    def _fails(self):
      self.assertEqual(len(SPEC["canary"]), 0)
    def _passes(self):
      self.assertEqual(SPEC["canary"], SPEC["canary"])
    canary = type("Canary_" + SPEC["canary"], (unittest.TestCase,),
                  {"test_fails": _fails, "test_passes": _passes})
    suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(canary))
  suite.run(Result())
  put("<done>", "done")
  os._exit(0)
os.close(w)
results, details, twice, done, late = {}, {}, [], False, True
buf = b""
deadline = _t0 + SPEC["deadline_s"]
while not done and time.monotonic() < deadline:
  if not select.select([r], [], [], deadline - time.monotonic())[0]:
    break
  chunk = os.read(r, 1 << 16)
  if not chunk:
    late = False  # The runner (and all that held its pipe) ended.
    break
  buf += chunk
  while b"\n" in buf and not done:
    line, buf = buf.split(b"\n", 1)
    try:
      name, status, detail = json.loads(line)
    except ValueError:
      twice.append("<garbled>")
      continue
    if name == "<done>":
      done = True
    elif name in results:
      twice.append(name)
    else:
      results[name] = status
      if detail and len(details) < 32:
        details[name] = str(detail)[-1500:]
try:
  os.kill(pid, signal.SIGKILL)
except OSError:
  pass
data = json.dumps({"results": results, "details": details, "twice": twice,
                   "done": done, "late": late and not done}).encode()
while data:
  data = data[os.write(_channel, data):]
'''


class WorkspaceMissing(RuntimeError):
  """The standard library's test files are not installed."""


@dataclasses.dataclass(frozen=True)
class Workspace:
  """A package and its tests: `sources` may be edited, `tests` may not."""

  name: str
  sources: dict[str, str]
  tests: dict[str, str]
  test_modules: tuple[str, ...]

  def files(self, sources: dict[str, str] | None = None) -> dict[str, str]:
    return {**(sources or self.sources), **self.tests}


def workspace(name: str) -> Workspace:
  """The clean workspace `name` (one of WORKSPACES)."""
  if name not in WORKSPACES:
    raise ValueError(f"repair workspace {name!r}: one of {list(WORKSPACES)}")
  if name in SHIPPED:
    return _shipped(name)
  module, test = STDLIB[name]
  lib = sysconfig.get_paths()["stdlib"]
  test_path = os.path.join(lib, "test", test + ".py")
  if not os.path.exists(test_path):
    raise WorkspaceMissing(
        f"{test_path} is missing: the repair workspaces need CPython's test "
        f"package (Debian: apt-get install {TESTSUITE_APT}).")
  with open(os.path.join(lib, module)) as f:
    source = f.read()
  with open(test_path) as f:
    tests = f.read()
  return Workspace(name, {module: source}, {test + ".py": tests}, (test,))


def _shipped(name: str) -> Workspace:
  root = os.path.join(_SHIPPED_DIR, name)
  sources, tests = {}, {}
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__")
    for f in sorted(files):
      if f.endswith(".py.txt"):  # Stored as text: not the repo's Python.
        path = os.path.relpath(os.path.join(folder, f), root)[:-4]
        with open(os.path.join(folder, f)) as fh:
          (tests if "/" not in path and f.startswith("test_") else
           sources)[path] = fh.read()
  return Workspace(name, sources, tests,
                   tuple(sorted(p[:-3] for p in tests)))


def buggy_workspace(clean: Workspace, seed: int
                    ) -> tuple[Workspace, str, mutations.Mutation] | None:
  """`clean` with the bug of `seed` (the seed picks the file too, among
  those with a mutation site): (workspace, path, mutation), or None."""
  paths = [p for p, text in sorted(clean.sources.items())
           if any(mutations.sites(text).values())]
  if not paths:
    return None
  path = paths[random.Random(seed).randrange(len(paths))]
  bug = mutations.mutate(clean.sources[path], seed)
  if bug is None:
    return None
  text, mutation = bug
  return (dataclasses.replace(clean, sources={**clean.sources, path: text}),
          path, mutation)


@dataclasses.dataclass(frozen=True)
class RepairTask:
  """A workspace with one bug. `broken`: tests the bug fails; `passing`:
  every test that passes on the reference (the grade needs them all)."""

  name: str
  seed: int
  buggy: Workspace
  reference: dict[str, str]
  mutation: mutations.Mutation
  broken: tuple[str, ...]
  passing: tuple[str, ...]
  path: str = ""  # The file the bug is in.


@dataclasses.dataclass(frozen=True)
class TestRun:
  """What the checker reported: status per test id ('pass', 'fail',
  'error', 'skip'), failure texts, whether the runner finished, ids
  reported more than once."""

  results: dict[str, str]
  details: dict[str, str]
  done: bool
  twice: tuple[str, ...]
  why: str = ""


@dataclasses.dataclass(frozen=True)
class RepairGrade:
  passed: bool
  why: str = ""


def run_tests(pool: SandboxPool, files: dict[str, str],
              modules: tuple[str, ...], canary: str = "") -> TestRun:
  """Runs the unittest `modules` on the tree `files` in one call."""
  result = pool.run(_HARNESS % repr(json.dumps({
      "files": files, "modules": list(modules), "canary": canary,
      "evict": [_module_name(p) for p in files if p.endswith(".py")],
      "deadline_s": pool.limits.wall_s * _DEADLINE_S})))
  got = harness_answer(result.stdout)
  if result.sandbox_error or got is None or not isinstance(
      got.get("results"), dict):
    why = result.sandbox_error or ("timed out" if result.timed_out else
                                   "no answer from the checker")
    return TestRun({}, {}, False, (), why)
  done = got.get("done") is True
  why = "" if done else ("the tests did not finish in time" if got.get(
      "late") else "the test run ended before it finished")
  return TestRun({str(k): str(v) for k, v in got["results"].items()},
                 {str(k): str(v) for k, v in got.get("details", {}).items()},
                 done, tuple(got.get("twice", ())), why)


class RepairGrader:
  """Repair tasks and grades of candidates.

  Args:
    pool: a grading pool (standard library only: `functions.make_pool`).
    vet: refuse edits naming capabilities (`vetting.refusal`); False only
      to test the sandbox-side defences alone.
  """

  def __init__(self, pool: SandboxPool, vet: bool = True):
    self.pool = pool
    self.vet = vet
    self._reference: dict[str, tuple[str, ...]] = {}
    self._lock = threading.Lock()

  def reference_passing(self, ws: Workspace) -> tuple[str, ...]:
    """Ids of the tests that pass on the clean workspace (run once)."""
    with self._lock:
      if ws.name in self._reference:
        return self._reference[ws.name]
    canary = secrets.token_hex(6)
    run = run_tests(self.pool, ws.files(), ws.test_modules, canary)
    if not _canaries_right(run, canary) or not run.done:
      raise RuntimeError(f"the clean {ws.name} workspace's tests did not run:"
                         f" {run.why or run.results}")
    passing = tuple(sorted(k for k, v in run.results.items()
                           if v == "pass" and ".Canary_" not in k))
    failing = sorted(k for k, v in run.results.items() if v != "pass" and
                     ".Canary_" not in k)
    if failing:
      logging.info("%s: %d tests do not pass on the reference (left out): "
                   "%s", ws.name, len(failing), failing[:5])
    with self._lock:
      self._reference[ws.name] = passing
    return passing

  def task(self, name: str, seed: int) -> RepairTask | None:
    """Workspace `name` with the bug of `seed`, or None when that bug makes
    no test fail (or makes the tests hang)."""
    clean = workspace(name)
    passing = self.reference_passing(clean)
    bug = buggy_workspace(clean, seed)
    if bug is None:
      return None
    buggy, path, mutation = bug
    run = run_tests(self.pool, buggy.files(), buggy.test_modules)
    if not run.done:
      return None
    broken = tuple(t for t in passing if run.results.get(t) != "pass")
    if not broken:
      return None
    return RepairTask(name, seed, buggy, dict(clean.sources), mutation,
                      broken, passing, path)

  def tree(self, task: RepairTask, edits: dict[str, str]) -> dict[str, str]:
    """The tree a candidate is graded on: the task's tests, and the edited
    text of its source files (nothing else of `edits`)."""
    sources = {p: edits.get(p, t) for p, t in task.buggy.sources.items()}
    return task.buggy.files(sources)

  def refusal(self, task: RepairTask, edits: dict[str, str]) -> str:
    """Why the edits may not run beside the tests; '' when they may."""
    if not self.vet:
      return ""
    for path, text in edits.items():
      if path in task.buggy.sources and not isinstance(text, str):
        return f"{path}: not text"
      if path in task.buggy.sources and text != task.buggy.sources[path]:
        why = vetting.refusal(text, [task.buggy.sources[path],
                                     task.reference[path]], path)
        if why:
          return why
    return ""

  def grade(self, task: RepairTask, edits: dict[str, str]) -> RepairGrade:
    """Whether `edits` (path -> new text) repair `task`."""
    why = self.refusal(task, edits)
    if why:
      return RepairGrade(False, "refused: " + why)
    canary = secrets.token_hex(6)
    run = run_tests(self.pool, self.tree(task, edits),
                    task.buggy.test_modules, canary)
    if run.why:
      return RepairGrade(False, run.why)
    if run.twice:
      return RepairGrade(False, f"tests reported twice: {list(run.twice)[:3]}")
    if not _canaries_right(run, canary):
      return RepairGrade(False, "the canary tests came out wrong: the test "
                         "runner was tampered with")
    failing = [t for t in task.passing if run.results.get(t) != "pass"]
    if failing:
      broken = sum(t in task.broken for t in failing)
      return RepairGrade(False, f"{len(failing)} tests fail or are missing "
                         f"({broken} of the {len(task.broken)} the bug "
                         f"broke): {failing[:3]}")
    return RepairGrade(True)


def _module_name(path: str) -> str:
  name = path[:-3].replace("/", ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _canaries_right(run: TestRun, canary: str) -> bool:
  prefix = next((k.rsplit(".", 1)[0] for k in run.results
                 if f"Canary_{canary}." in k), None)
  return prefix is not None and (
      run.results.get(prefix + ".test_fails") == "fail" and
      run.results.get(prefix + ".test_passes") == "pass")


def task_info(task: RepairTask) -> dict[str, Any]:
  """A task's public description (no reference text)."""
  return {"name": task.name, "seed": task.seed,
          "files": sorted(task.buggy.files()),
          "sources": sorted(task.buggy.sources),
          "broken": len(task.broken), "tests": len(task.passing)}
