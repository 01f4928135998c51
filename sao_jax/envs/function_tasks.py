"""Write-a-function tasks from reasoning-gym's codeio rows, judged by hidden
tests (docs/design/grading.md; `env.dataset = 'codeio'`).

`reasoning_gym/data/codeio.jsonl.gz` (installed with reasoning-gym) holds
~3,000 rows: a task description, an input/output spec, a reference
`main_solution` and a seeded `generate_inputs`. A row is a task when both
programs parse, import only the standard library and define those two
functions; a stable hash of its description puts it in the held-out split
(1 in `HELDOUT_EVERY`) or the training split, whatever the seed. A task's
prompt is its description, spec and signature; the answer is code (the
`code` answer rule: the last fenced block); the score is the fraction of
its hidden tests the code passes (`grading.functions`), so the reward
'exact' pays 1 when all pass. A task whose reference cannot give tests
(it fails, does not repeat itself, or returns what JSON cannot hold) is
passed over: item `i` is the first valid task at or after position `i`.
"""

from __future__ import annotations

import ast
import atexit
import functools
import gzip
import hashlib
import json
import os
import random
import sys
import threading
from typing import Any

from sao_jax import reasoning_gym_import
from sao_jax.grading.functions import code_of
from sao_jax.grading.functions import FunctionGrader
from sao_jax.grading.functions import FunctionTask
from sao_jax.grading.functions import make_pool
from sao_jax.tokenization import tokenizer

NAME = "codeio"
HELDOUT_EVERY = 10
_PROMPT = ("{description}\n\n{spec}\n\nWrite a Python function "
           "`{entry}({params})` that takes the input above and returns the "
           "output. Use only the standard library. Answer with the complete "
           "code in one ```python block.")


def _data_path() -> str:
  """reasoning-gym's codeio file, found without importing reasoning-gym."""
  root = reasoning_gym_import.package_dir()
  if root is None:
    raise FileNotFoundError("reasoning-gym is not installed (pip install -e "
                            ".): its data/codeio.jsonl.gz holds the tasks.")
  return os.path.join(root, "data", "codeio.jsonl.gz")


# The fields holding statement lists: an import is a statement, so the walk
# need not enter expressions (most of a tree; all rows parse in 1/3 the time).
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _imports(tree: ast.AST) -> set[str]:
  names, stack = set(), [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, ast.Import):
      names |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      names.add((node.module or "").split(".")[0] if not node.level else "")
    for field in _BODIES:
      stack.extend(getattr(node, field, None) or ())
  return names


def _params(tree: ast.Module, entry: str) -> tuple[str, ...] | None:
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name == entry:
      return tuple(a.arg for a in node.args.args)
  return None


def _key(row: dict[str, Any]) -> str:
  """The digest of a row's description: its task's key and seed."""
  return hashlib.sha256(row["task_description"].encode()).hexdigest()


def task_from_row(row: dict[str, Any]) -> FunctionTask | None:
  """The row as a task, or None when it is not one (module docstring)."""
  try:
    ref = ast.parse(row["code_sample"])
    gen = ast.parse(row["input_generator"])
  except (SyntaxError, KeyError, TypeError, ValueError):
    return None
  if (_imports(ref) | _imports(gen)) - set(sys.stdlib_module_names):
    return None
  params = _params(ref, "main_solution")
  if params is None or _params(gen, "generate_inputs") is None:
    return None
  digest = _key(row)
  return FunctionTask(
      key=digest[:16], description=row["task_description"].strip(),
      spec=row["input_output_spec"].strip(), reference=row["code_sample"],
      generator=row["input_generator"], params=params,
      seed=int(digest[16:24], 16))


def _short(code: str | None, max_reference_chars: int) -> bool:
  return not max_reference_chars or len(code or "") <= max_reference_chars


@functools.lru_cache(maxsize=None)
def all_tasks(max_reference_chars: int = 0) -> tuple[FunctionTask, ...]:
  """Every codeio row that is a task, ordered by key; of rows with one
  description, the last that is a task. With `max_reference_chars`, only
  those whose reference is at most that long: a description none of whose
  rows is that short is passed over unparsed (parsing every row is most of
  the time a short split takes)."""
  with gzip.open(_data_path(), "rt") as f:
    rows = [json.loads(line) for line in f]
  groups: dict[str, list[dict[str, Any]]] = {}
  for row in rows:
    groups.setdefault(_key(row)[:16], []).append(row)
  tasks = []
  for group in groups.values():
    if not any(_short(r.get("code_sample"), max_reference_chars)
               for r in group):
      continue
    task = next(filter(None, map(task_from_row, reversed(group))), None)
    if task is not None and _short(task.reference, max_reference_chars):
      tasks.append(task)
  return tuple(sorted(tasks, key=lambda t: t.key))


def split(name: str, max_reference_chars: int = 0
          ) -> tuple[FunctionTask, ...]:
  """'train' or 'heldout' (1 in HELDOUT_EVERY by key, disjoint); with
  `max_reference_chars`, only tasks whose reference is at most that long
  (a difficulty knob: it bounds the answer's length too)."""
  if name not in ("train", "heldout"):
    raise ValueError(f"split {name!r}: use 'train' or 'heldout'.")
  heldout = name == "heldout"
  return tuple(t for t in all_tasks(int(max_reference_chars))
               if (int(t.key, 16) % HELDOUT_EVERY == 0) == heldout)


def prompt(task: FunctionTask) -> str:
  return _PROMPT.format(description=task.description, spec=task.spec,
                        entry=task.entry, params=", ".join(task.params))


def demonstration(task: FunctionTask) -> str:
  """The reference as an answer (SFT warm start)."""
  return "```python\n" + task.reference.strip() + "\n```"


class FunctionTasks:
  """A seeded set of function tasks with the interface of
  `ReasoningGymTasks` (entries, prompt ids, `score`)."""

  def __init__(self, split_name: str, grader: FunctionGrader, *, seed: int,
               size: int, max_reference_chars: int = 0):
    pool = list(split(split_name, max_reference_chars))
    if not pool:
      raise ValueError(f"no codeio tasks in the {split_name!r} split.")
    random.Random(seed).shuffle(pool)
    self.name = NAME
    self.split = split_name
    self.seed = int(seed)
    self.size = int(size)
    self.grader = grader
    self._order = pool
    self._at: dict[int, FunctionTask] = {}

  def __len__(self) -> int:
    return self.size

  def task(self, index: int) -> FunctionTask:
    """The first valid task at or after position `index` of the order."""
    if not 0 <= index < self.size:
      raise IndexError(f"task index {index} not in [0, {self.size}).")
    if index not in self._at:
      n = len(self._order)
      for step in range(n):
        candidate = self._order[(index + step) % n]
        if self.grader.hidden_tests(candidate) is not None:
          self._at[index] = candidate
          break
      else:
        raise ValueError("no codeio task of this split has hidden tests.")
    return self._at[index]

  def entry(self, index: int) -> dict[str, Any]:
    task = self.task(index)
    return {"question": prompt(task), "answer": demonstration(task),
            "key": task.key}

  def prompt_id(self, index: int) -> int:
    """From the task's key: the same task, the same id (< 2**28: batches
    hold it as int32)."""
    return int(self.task(index).key[:7], 16)

  def score(self, answer: str, index: int) -> float:
    """The fraction of the task's hidden tests that the code in `answer`
    (its last fenced block, else all of it) passes."""
    return self.grader.grade(code_of(answer), self.task(index)).fraction


_GRADERS: dict[tuple, FunctionGrader] = {}
_GRADERS_LOCK = threading.Lock()


def shared_grader(env_cfg: Any) -> FunctionGrader:
  """This process's grader for `env_cfg` (its sandbox mechanism and
  workers; standard library only), made once; closed at exit."""
  key = (str(env_cfg.code_sandbox), int(env_cfg.code_workers))
  with _GRADERS_LOCK:
    if key not in _GRADERS:
      _GRADERS[key] = FunctionGrader(make_pool(key[0], key[1]))
    return _GRADERS[key]


@atexit.register
def close_graders() -> None:
  with _GRADERS_LOCK:
    for grader in _GRADERS.values():
      grader.pool.close()
    _GRADERS.clear()


def corpus(n: int) -> list[tuple[str, str]]:
  """(prompt, reference answer) of `n` training tasks (tokenizer text)."""
  return [(prompt(t), demonstration(t)) for t in split("train")[:n]]


tokenizer.CORPUS_SOURCES[NAME] = corpus


def train_eval_tasks(env_cfg: Any) -> tuple[FunctionTasks, FunctionTasks]:
  """(training tasks, held-out tasks): the two splits, disjoint by
  construction (`split`)."""
  grader = shared_grader(env_cfg)
  settings = dict(env_cfg.dataset_config)
  unknown = set(settings) - {"max_reference_chars"}
  if unknown:
    raise ValueError(f"env.dataset_config {sorted(unknown)}: the codeio tasks "
                     "take only max_reference_chars (0 = any length).")
  limit = int(settings.get("max_reference_chars", 0))
  return (FunctionTasks("train", grader, seed=env_cfg.seed,
                        size=env_cfg.size, max_reference_chars=limit),
          FunctionTasks("heldout", grader, seed=env_cfg.eval_seed,
                        size=env_cfg.eval_size, max_reference_chars=limit))
