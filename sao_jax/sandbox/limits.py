"""What a sandboxed call may use, and what it returns (docs/design/sandbox.md
"Code sandbox")."""

from __future__ import annotations

import dataclasses
from typing import Any

from sao_jax import ranges


# The allowed value of each `Limits` field (`ranges`); config_validation checks
# env.code_<field> with them.
FIELD_RULES = {
    "wall_s": ranges.FINITE_GT0,
    "total_memory_mb": ranges.Rule(
        lambda v: ranges.is_int(v) and v >= 0,
        "an int >= 0 (0: no memory cgroup)"),
    **{k: ranges.POSITIVE for k in (
        "cpu_s", "memory_mb", "processes", "open_files", "file_size_mb",
        "scratch_mb", "output_bytes")},
}


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-call bounds. Sizes in MiB unless named otherwise.

  Attributes:
    wall_s: wall-clock time of one call (the server kills it after).
    cpu_s: CPU seconds of the call's process (RLIMIT_CPU, SIGXCPU).
    memory_mb: address space of each process (RLIMIT_AS).
    total_memory_mb: all processes of one sandbox together (memory cgroup,
      where one can be made; 0 = none).
    processes: processes of the sandbox's uid (RLIMIT_NPROC; and pids.max).
    open_files: RLIMIT_NOFILE.
    file_size_mb: largest file a call may write (RLIMIT_FSIZE).
    scratch_mb: size of the private scratch, /tmp and /dev/shm tmpfs each.
    output_bytes: stdout and stderr are each cut here (and the call killed).
  """

  wall_s: float = 5.0
  cpu_s: int = 5
  memory_mb: int = 1024
  total_memory_mb: int = 1536
  processes: int = 32
  open_files: int = 64
  file_size_mb: int = 16
  scratch_mb: int = 64
  output_bytes: int = 65536

  def __post_init__(self):
    ranges.check_fields(self, FIELD_RULES)

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CallResult:
  """One call's outcome, as the code tool shows it to the policy.

  Attributes:
    stdout, stderr: decoded output (invalid UTF-8 replaced), each at most
      `Limits.output_bytes` bytes.
    exit_code: the process's exit status; -N when killed by signal N.
    timed_out: wall or CPU limit reached.
    memory_error: MemoryError (RLIMIT_AS) or a kill by the memory cgroup.
    truncated: stdout or stderr was cut (the process was killed there).
    exec_s: wall seconds of the call as the server measured it.
    sandbox_error: the sandbox itself failed (it is restarted); '' if none.
  """

  stdout: str
  stderr: str
  exit_code: int
  timed_out: bool = False
  memory_error: bool = False
  truncated: bool = False
  exec_s: float = 0.0
  sandbox_error: str = ""

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "CallResult":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})
