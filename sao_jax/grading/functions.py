"""Function tasks judged by hidden tests (docs/design/grading.md).

A task is a description, a signature and a trusted reference with an input
generator (reasoning-gym's codeio rows). The hidden tests are `n_tests`
inputs drawn from the generator with the task's own seed; the expected
outputs come from the reference, run twice (a task whose reference does not
repeat itself, fails, or returns what JSON cannot hold is no task) in a
sandbox call of its own. A candidate is graded in another call that gets
the inputs and the candidate's source, never the expected outputs; what it
returns comes back as JSON over the harness's own copy of stdout (the
candidate's prints go to /dev/null) and is compared on the host.

What this makes worthless: exiting early (no answer: 0), printing a fake
pass line (not read), writing a fake result (it would have to hold the
expected values, which are not in the sandbox), returning objects that
claim equality (they are not JSON), patching the harness (it only carries
the candidate's own values), reading the task data (the sandbox has the
standard library only, not the venv), hanging or forking away (the
sandbox's time limit and per-call namespaces).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Any

from sao_jax.grading import values
from sao_jax.sandbox.limits import Limits
from sao_jax.sandbox.pool import SandboxPool

LIMITS = Limits(wall_s=10.0, cpu_s=10, memory_mb=1024, total_memory_mb=1536,
                processes=16, output_bytes=1 << 20)

# The start of every harness: its one input is SPEC (JSON); its one output, a
# JSON object, goes to `_channel`, a copy of fd 1, after fd 1 itself is sent
# to /dev/null (what the candidate prints never reaches the host).
CHANNEL_PREAMBLE = r'''
import json, os, sys
SPEC = json.loads(%s)
_channel = os.dup(1)
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 1)
sys.stdout = open(1, "w", closefd=False)
'''

_HARNESS = CHANNEL_PREAMBLE + r'''
import copy, random

def _emit(obj):
  data = json.dumps(obj).encode()
  while data:
    data = data[os.write(_channel, data):]

def _load(source, name, **names):
  scope = {"__name__": name, **names}
  exec(compile(source, "<" + name + ">", "exec"), scope)
  return scope

def _plain(value):
  try:
    return json.dumps(value, sort_keys=True)
  except (TypeError, ValueError, RecursionError):
    return None

def _outputs(fn, inputs):
  out = []
  for args in inputs:
    try:
      out.append(_plain(fn(**copy.deepcopy(args))))
    except BaseException:
      out.append(None)
  return out

if SPEC["mode"] == "reference":
  try:
    gen = _load(SPEC["generator"], "generator",
                Random=random.Random)["generate_inputs"]
    inputs = [json.loads(json.dumps(gen(random.Random(SPEC["seed"] + i))))
              for i in range(SPEC["n"])]
    runs = [_outputs(_load(SPEC["source"], "reference")[SPEC["entry"]],
                     inputs) for _ in range(2)]
    _emit({"inputs": inputs, "outputs": runs[0],
           "deterministic": runs[0] == runs[1]})
  except BaseException as e:
    _emit({"error": type(e).__name__ + ": " + str(e)[:200]})
else:
  try:
    fn = _load(SPEC["source"], "candidate")[SPEC["entry"]]
  except BaseException as e:
    _emit({"error": type(e).__name__})
  else:
    _emit({"outputs": _outputs(fn, SPEC["inputs"])})
'''


@dataclasses.dataclass(frozen=True)
class FunctionTask:
  """One task: `key` is stable (from its description); `seed` draws its
  hidden inputs."""

  key: str
  description: str
  spec: str
  reference: str
  generator: str
  params: tuple[str, ...]
  seed: int
  entry: str = "main_solution"


@dataclasses.dataclass(frozen=True)
class HiddenTests:
  inputs: list[dict[str, Any]]
  expected: list[Any]


@dataclasses.dataclass(frozen=True)
class Grade:
  """`passed` of `total` hidden tests; `why` says what went wrong."""

  passed: int
  total: int
  why: str = ""

  @property
  def fraction(self) -> float:
    return self.passed / self.total if self.total else 0.0


_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def code_of(reply: str) -> str:
  """The code in a reply: its last fenced block, else the reply itself."""
  blocks = _FENCE.findall(reply)
  return blocks[-1] if blocks else reply


def harness(spec: dict[str, Any]) -> str:
  """The sandbox program for `spec` (the harness above)."""
  return _HARNESS % repr(json.dumps(spec))


def harness_answer(stdout: str) -> dict[str, Any] | None:
  """The harness's JSON object, if stdout is exactly one."""
  try:
    obj = json.loads(stdout)
  except ValueError:
    return None
  return obj if isinstance(obj, dict) else None


class FunctionGrader:
  """Hidden tests for function tasks, and grades of candidates.

  Args:
    pool: a sandbox pool whose calls see the standard library only
      (`SandboxPool(..., packages=False)`); see `make_pool`.
    n_tests: hidden tests per task.
  """

  def __init__(self, pool: SandboxPool, n_tests: int = 8):
    if n_tests < 1:
      raise ValueError(f"n_tests={n_tests} must be >= 1.")
    self.pool = pool
    self.n_tests = n_tests
    self._tests: dict[str, HiddenTests | None] = {}
    self._why: dict[str, str] = {}
    self._lock = threading.Lock()

  def hidden_tests(self, task: FunctionTask) -> HiddenTests | None:
    """The task's tests (computed once, in a sandbox call), or None when
    its reference cannot give them (`why_invalid` says why)."""
    with self._lock:
      if task.key in self._tests:
        return self._tests[task.key]
    result = self.pool.run(harness({
        "mode": "reference", "generator": task.generator,
        "source": task.reference, "entry": task.entry, "seed": task.seed,
        "n": self.n_tests}))
    got = harness_answer(result.stdout)
    why = ""
    if result.sandbox_error or result.timed_out or got is None:
      why = (result.sandbox_error or ("timed out" if result.timed_out else
                                      "no answer: " + result.stderr[-200:]))
    elif "error" in got:
      why = got["error"]
    elif not got["deterministic"]:
      why = "the reference does not repeat itself"
    elif None in got["outputs"]:
      why = "the reference failed or returned what JSON cannot hold"
    tests = None if why else HiddenTests(
        got["inputs"], [json.loads(o) for o in got["outputs"]])
    with self._lock:
      self._tests[task.key] = tests
      self._why[task.key] = why
    return tests

  def why_invalid(self, task: FunctionTask) -> str:
    return self._why.get(task.key, "")

  def grade(self, code: str, task: FunctionTask) -> Grade:
    """How many hidden tests `code` passes (its `task.entry` function)."""
    tests = self.hidden_tests(task)
    if tests is None:
      raise ValueError(f"task {task.key} has no hidden tests: "
                       f"{self.why_invalid(task)}")
    total = len(tests.inputs)
    result = self.pool.run(harness({
        "mode": "candidate", "source": code, "entry": task.entry,
        "inputs": tests.inputs}))
    got = harness_answer(result.stdout)
    if got is None or result.sandbox_error:
      return Grade(0, total, result.sandbox_error or (
          "timed out" if result.timed_out else "no answer from the harness"))
    outputs = got.get("outputs")
    if not isinstance(outputs, list) or len(outputs) != total:
      return Grade(0, total, str(got.get("error", "malformed answer")))
    passed = 0
    for expected, text in zip(tests.expected, outputs):
      try:
        passed += isinstance(text, str) and values.same(expected,
                                                        json.loads(text))
      except (ValueError, RecursionError):
        pass
    return Grade(passed, total)


def make_pool(mechanism: str = "auto", workers: int = 1,
              limits: Limits = LIMITS) -> SandboxPool:
  """A warm pool for grading: standard library only, the grader's limits."""
  return SandboxPool(limits, workers=workers, mode="warm",
                     mechanism=mechanism, packages=False)
