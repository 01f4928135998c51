"""Repository repair as a multi-turn environment (`env.name = 'repair'`;
docs/design/grading.md "Repository repair").

Each episode gets its own workspace: the task's buggy files, held in this
process's memory, dropped when the episode ends or the next one starts
(nothing of it is on disk; the sandbox calls that run its tests leave
nothing either). The policy calls tools, in every template as a JSON
object `{"name": TOOL, "arguments": {...}}` inside the template's call
markup:

- `read_file` {path, start?, end?}: the file's text, or its lines start to
  end (1-based, inclusive; every observation is cut to
  `observation_chars`);
- `write_file` {path, content}: replaces or makes a file;
- `str_replace` {path, old, new}: replaces the one occurrence of `old`;
- `run_tests` {}: the workspace's visible tests, run in the grading sandbox
  with the workspace as it is; a changed or new file (tests too) that the
  vetting refuses is refused here, saying why (else a test's failure
  message could carry the standard library's copy of the reference back).

Any other action submits: the reward is the grade of the workspace's
source files (`RepairGrader.grade`: a clean tree, the task's own tests).

A task's demonstration (`RepairTasks.entry`, the SFT warm start's and the
derived lengths' example) is a scripted episode from the reference fix:
`run_tests`, `read_file` of the lines around the bug, `str_replace` of the
buggy lines by the reference's, then the submission; its observations are
what this environment returns for those calls.
"""

from __future__ import annotations

import difflib
import json
import posixpath
import threading
import zlib
from typing import Any, Sequence

from sao_jax.envs.base import Environment
from sao_jax.envs.base import StepResult
from sao_jax.grading import repair
from sao_jax.grading import vetting

TOOLS = ("read_file", "write_file", "str_replace", "run_tests")
MAX_FILES = 32
MAX_FILE_CHARS = 200_000
_PROMPT = (
    "The Python package below has a bug: some of its tests fail. Find and "
    "fix it in the source (not in the tests). Files: {files}. The failing "
    "tests are among those in {tests}.\n\nTools (call one at a time, as a "
    'JSON object {{"name": ..., "arguments": {{...}}}}): read_file {{"path", '
    '"start", "end"}} (lines; optional)'
    ', write_file {{"path", "content"}}, str_replace {{"path", "old", '
    '"new"}}, run_tests {{}}. Answer without a tool call to submit.')


SUBMIT = "Fixed the bug in {path}."  # The demonstrations' final answer.
CONTEXT_LINES = 3  # Lines a demonstration reads on each side of the bug.
NAME = "repair"
HELDOUT_EVERY = 10  # Seeds = 9 mod 10 are held out, the others train.
SEEDS_PER_TASK = 16  # Seeds an index may try before it gives up.


class RepairTasks:
  """Repair tasks of `names`, found per index: task `index` is workspace
  `names[index % len(names)]` with the first kept bug among its own
  `SEEDS_PER_TASK` seeds of the split (from `first_seed` on), so an index
  costs a few sandbox calls whatever its value. The splits' seeds are
  disjoint (held out: = 9 mod 10) whatever `first_seed`."""

  name = NAME

  def __init__(self, grader: repair.RepairGrader, names: Sequence[str],
               size: int, first_seed: int = 0, split: str = "train",
               observation_chars: int = 2048):
    if split not in ("train", "heldout"):
      raise ValueError(f"repair split {split!r}: 'train' or 'heldout'.")
    unknown = set(names) - set(repair.WORKSPACES)
    if unknown or not names:
      raise ValueError(f"repair workspaces {sorted(unknown) or names}: use "
                       f"some of {sorted(repair.WORKSPACES)}.")
    self.grader = grader
    self.names = tuple(names)
    self.size = size
    self.split = split
    self.first_seed = first_seed
    self.observation_chars = observation_chars  # The env's, for entry().
    self._tasks: dict[int, repair.RepairTask] = {}
    self._entries: dict[int, dict[str, Any]] = {}
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return self.size

  def seed(self, k: int) -> int:
    """The split's k-th seed."""
    if self.split == "heldout":
      return HELDOUT_EVERY * k + HELDOUT_EVERY - 1
    per = HELDOUT_EVERY - 1
    return HELDOUT_EVERY * (k // per) + k % per

  def task(self, index: int) -> repair.RepairTask:
    if not 0 <= index < self.size:
      raise IndexError(f"repair task {index} of {self.size}")
    with self._lock:
      if index in self._tasks:
        return self._tasks[index]
    name = self.names[index % len(self.names)]
    first = self.first_seed + index * SEEDS_PER_TASK
    for k in range(first, first + SEEDS_PER_TASK):
      found = self.grader.task(name, self.seed(k))
      if found is not None:
        with self._lock:
          self._tasks[index] = found
        return found
    last = self.seed(first + SEEDS_PER_TASK - 1)
    raise RuntimeError(f"repair task {index}: no bug of {name} among seeds "
                       f"{self.seed(first)}..{last} breaks a test")

  def entry(self, index: int) -> dict[str, Any]:
    """The task's prompt (`question`), its demonstration's tool calls
    (`tool_calls`: (JSON payload, observation) pairs) and final `answer`
    (module docstring); made once per index (one sandbox call)."""
    with self._lock:
      if index in self._entries:
        return self._entries[index]
    task = self.task(index)
    first, last, old, new = bug_hunk(task.buggy.sources[task.path],
                                     task.reference[task.path])
    env = RepairEnv(self, observation_chars=self.observation_chars)
    env.open(index)
    calls = []
    for name, args in (
        ("run_tests", {}),
        ("read_file", {"path": task.path,
                       "start": max(1, first - CONTEXT_LINES),
                       "end": last + CONTEXT_LINES}),
        ("str_replace", {"path": task.path, "old": old, "new": new})):
      payload = json.dumps({"name": name, "arguments": args})
      calls.append((payload, _cut(env.run_tool(payload),
                                  self.observation_chars)))
    entry = {"question": prompt(task), "tool_calls": calls,
             "answer": SUBMIT.format(path=task.path)}
    with self._lock:
      self._entries[index] = entry
    return entry

  def prompt_id(self, index: int) -> int:
    t = self.task(index)
    return zlib.crc32(f"{t.name}/{t.seed}".encode()) & 0x7FFFFFFF


def prompt(task: repair.RepairTask) -> str:
  """The task's question (before the template and `env.instruction`)."""
  return _PROMPT.format(files=", ".join(sorted(task.buggy.files())),
                        tests=", ".join(sorted(task.buggy.tests)))


def bug_hunk(buggy: str, fixed: str) -> tuple[int, int, str, str]:
  """(first, last line (1-based) of the buggy lines, their text, the fixed
  text): the lines where `buggy` and `fixed` differ, grown by whole lines on
  both sides until the buggy text occurs once in `buggy` (a `str_replace`
  of it is then the fix)."""
  a, b = buggy.splitlines(keepends=True), fixed.splitlines(keepends=True)
  ops = [op for op in difflib.SequenceMatcher(
      None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
  if not ops:
    raise ValueError("bug_hunk: the two texts are the same.")
  i1, i2 = ops[0][1], ops[-1][2]
  j1, j2 = ops[0][3], ops[-1][4]
  while not (i2 > i1 and buggy.count("".join(a[i1:i2])) == 1):
    i1, j1 = (i1 - 1, j1 - 1) if i1 > 0 else (i1, j1)
    i2, j2 = (i2 + 1, j2 + 1) if i2 < len(a) else (i2, j2)
  return i1 + 1, i2, "".join(a[i1:i2]), "".join(b[j1:j2])


def train_eval_tasks(env_cfg: Any, pool: Any) -> tuple[RepairTasks,
                                                        RepairTasks]:
  """(training, held-out) repair tasks of `env_cfg` (`env.dataset_config`:
  `workspaces`, a list of WORKSPACES keys; all by default), graded in
  `pool` (a grading pool)."""
  settings = dict(env_cfg.dataset_config)
  if set(settings) - {"workspaces"}:
    raise ValueError(f"env.dataset_config {sorted(settings)}: the repair "
                     "tasks take only `workspaces`.")
  names = tuple(settings.get("workspaces") or sorted(repair.WORKSPACES))
  grader = repair.RepairGrader(pool)
  chars = int(env_cfg.code_observation_chars)
  return (RepairTasks(grader, names, env_cfg.size, env_cfg.seed, "train",
                      chars),
          RepairTasks(grader, names, env_cfg.eval_size, env_cfg.eval_seed,
                      "heldout", chars))


class RepairEnv(Environment):
  """One repair episode at a time (module docstring)."""

  def __init__(self, tasks: RepairTasks, instruction: str = "",
               max_tool_calls: int = 16, observation_chars: int = 2048):
    self.tasks = tasks
    self.name = tasks.name
    self.instruction = instruction
    self.max_tool_calls = max_tool_calls
    self.observation_chars = observation_chars
    self.workspace: dict[str, str] | None = None
    self._task: repair.RepairTask | None = None
    self._calls = 0

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    return {**super().config_kwargs(env_cfg, reward),
            "max_tool_calls": env_cfg.max_tool_calls,
            "observation_chars": int(env_cfg.code_observation_chars)}

  def open(self, task: int) -> None:
    """Starts an episode of `task`: its own copy of the buggy tree."""
    self._task = self.tasks.task(task)
    self.prompt_id = self.tasks.prompt_id(task)
    self.workspace = dict(self._task.buggy.files())  # This episode's own.
    self._calls = 0

  def reset(self, task: int) -> str:
    self.open(task)
    return self.template.format_prompt(prompt(self._task) + self.instruction)

  def step(self, action_text: str) -> StepResult:
    if self.workspace is None or self._task is None:
      raise RuntimeError("RepairEnv.step called outside an episode.")
    if not self.template.is_tool_call(action_text):
      return self._submit()
    payload = self.template.parse_tool_call(action_text)
    self._calls += 1
    if self._calls > self.max_tool_calls:
      value = f"error: more than {self.max_tool_calls} tool calls"
    else:
      value = self.run_tool(payload)
    value = _cut(value, self.observation_chars)
    return StepResult(self.template.format_tool_result(value), 0.0, False,
                      {"tool_call": payload, "tool_result": value})

  def _submit(self) -> StepResult:
    task, files = self._task, self.workspace
    self.workspace = self._task = None  # The workspace ends with the episode.
    grade = self.tasks.grader.grade(task, {p: files.get(p, "") for p in
                                           task.buggy.sources})
    return StepResult("", float(grade.passed), True,
                      {"repair_why": grade.why, "tool_calls": self._calls})

  def run_tool(self, payload: str) -> str:
    """The observation of one tool call."""
    try:
      call = json.loads(payload)
      name, args = call["name"], call.get("arguments", {})
      if isinstance(args, str):
        args = json.loads(args)
      if name not in TOOLS or not isinstance(args, dict):
        raise ValueError
    except (ValueError, TypeError, KeyError):
      return (f'error: call a tool as {{"name": one of {list(TOOLS)}, '
              '"arguments": {...}}')
    try:
      return getattr(self, "_" + name)(**args)
    except TypeError as e:
      return f"error: {name}: {e}"

  def _path(self, path: Any) -> str:
    norm = posixpath.normpath(str(path)) if isinstance(path, str) else ""
    if not norm or norm.startswith(("/", "..")) or norm == ".":
      raise TypeError(f"{path!r} is not a path in the workspace")
    return norm

  def _read_file(self, path: str, start: int = 1,
                 end: int | None = None) -> str:
    path = self._path(path)
    if path not in self.workspace:
      return f"error: no file {path}; files: {sorted(self.workspace)}"
    text = self.workspace[path]
    if (start, end) == (1, None):
      return text
    if not isinstance(start, int) or not isinstance(end, (int, type(None))):
      return "error: start and end are line numbers"
    return "".join(text.splitlines(keepends=True)[max(start, 1) - 1:end])

  def _write_file(self, path: str, content: str) -> str:
    path = self._path(path)
    if not isinstance(content, str) or len(content) > MAX_FILE_CHARS:
      return f"error: content must be text of at most {MAX_FILE_CHARS} chars"
    if path not in self.workspace and len(self.workspace) >= MAX_FILES:
      return f"error: at most {MAX_FILES} files"
    self.workspace[path] = content
    return f"wrote {path} ({len(content)} chars)"

  def _str_replace(self, path: str, old: str, new: str) -> str:
    text = self._read_file(path)  # The whole file.
    path = self._path(path)
    if path not in self.workspace:
      return text
    count = text.count(old) if isinstance(old, str) and old else 0
    if count != 1:
      return f"error: `old` occurs {count} times in {path}; it must be once"
    return self._write_file(path, text.replace(old, str(new)))

  def _run_tests(self) -> str:
    task = self._task
    why = self._refusal()
    if why:
      return "refused: " + why
    run = repair.run_tests(self.tasks.grader.pool, self.workspace,
                           task.buggy.test_modules)
    bad = sorted(k for k, v in run.results.items() if v != "pass")
    lines = [f"{len(run.results) - len(bad)} passed, {len(bad)} failed"
             + (f" ({run.why})" if run.why else "")]
    for test in bad[:8]:
      lines.append(f"{run.results[test].upper()}: {test}")
    for test in bad[:2]:
      lines.append(run.details.get(test, "")[-600:])
    return "\n".join(lines)


  def _refusal(self) -> str:
    """What the vetting refuses in any changed or new file (tests too: a
    failure's message would carry what a test read back to the policy)."""
    task, original = self._task, self._task.buggy.files()
    for path, text in sorted(self.workspace.items()):
      if text != original.get(path):
        allowed = [original[path], task.reference.get(
            path, original[path])] if path in original else [""]
        why = vetting.refusal(text, allowed, path)
        if why:
          return why
    return ""


def _cut(text: str, chars: int) -> str:
  mark = "[truncated]"
  return text if len(text) <= chars else text[:chars - len(mark)] + mark
