"""A memory + pids cgroup per sandbox, where this process may make one
(docs/design/sandbox.md "Code sandbox"): RLIMIT_AS bounds each process, the
memory cgroup bounds their sum. cgroup v1 (memory and pids hierarchies) and
v2."""

from __future__ import annotations

import itertools
import os
import time

_ROOT = "/sys/fs/cgroup"
_COUNTER = itertools.count()


def _own_paths() -> dict[str, str]:
  """controller ('memory', 'pids', '' for v2) -> this process's cgroup dir."""
  out = {}
  try:
    with open("/proc/self/cgroup") as f:
      lines = f.read().splitlines()
  except OSError:
    return out
  for line in lines:
    _, controllers, path = line.split(":", 2)
    for c in controllers.split(",") if controllers else [""]:
      base = (os.path.join(_ROOT, c) if c else
              _ROOT if os.path.exists(os.path.join(_ROOT, "cgroup.controllers"))
              else os.path.join(_ROOT, "unified"))
      if c in ("memory", "pids", ""):
        out[c] = os.path.join(base, path.lstrip("/"))
  return out


class Cgroup:
  """Made by `create`; `procs_files` are written with a child's pid before
  exec (the launcher's preexec); `close` removes the directories."""

  def __init__(self, dirs: list[str], kind: str):
    self.dirs = dirs
    self.kind = kind  # 'v1', 'v2' or 'none'.
    self.procs_files = [os.path.join(d, "cgroup.procs") for d in dirs]

  @classmethod
  def create(cls, total_memory_mb: int, processes: int) -> "Cgroup":
    """A new cgroup with the limits, or an empty one (kind 'none')."""
    if total_memory_mb <= 0:
      return cls([], "none")
    name = f"sao_sandbox_{os.getpid()}_{next(_COUNTER)}"
    paths = _own_paths()
    limit = str(total_memory_mb << 20)
    v1 = {"memory": [("memory.limit_in_bytes", limit),
                     ("memory.memsw.limit_in_bytes", limit)],
          "pids": [("pids.max", str(processes + 4))]}
    made = []
    try:
      if "memory" in paths:
        for ctl, files in v1.items():
          if ctl not in paths:
            continue
          d = os.path.join(paths[ctl], name)
          os.mkdir(d)
          made.append(d)
          for fname, value in files:
            if os.path.exists(os.path.join(d, fname)):
              _write(os.path.join(d, fname), value)
        return cls(made, "v1")
      d = os.path.join(paths.get("", _ROOT), name)
      os.mkdir(d)
      made.append(d)
      _write(os.path.join(d, "memory.max"), limit)
      _write(os.path.join(d, "memory.swap.max"), "0")
      _write(os.path.join(d, "pids.max"), str(processes + 4))
      return cls(made, "v2")
    except OSError:
      cls(made, "none").close()
      return cls([], "none")

  def oom_kills(self) -> int:
    """Processes the memory limit killed so far; 0 without a cgroup."""
    if not self.dirs:
      return 0
    name = "memory.events" if self.kind == "v2" else "memory.oom_control"
    try:
      with open(os.path.join(self.dirs[0], name)) as f:
        for line in f:
          if line.startswith("oom_kill "):
            return int(line.split()[1])
    except (OSError, ValueError):
      pass
    return 0

  def close(self, timeout_s: float = 2.0) -> None:
    """Removes the cgroup once its processes are gone."""
    end = time.monotonic() + timeout_s
    for d in self.dirs:
      while True:
        try:
          os.rmdir(d)
          break
        except FileNotFoundError:
          break
        except OSError:
          if time.monotonic() > end:
            break
          time.sleep(0.001)
    self.dirs = []


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)
