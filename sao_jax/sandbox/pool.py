"""Sandboxed interpreters for untrusted Python: warm pools and strict
one-shot sandboxes (docs/design/sandbox.md "Code sandbox").

warm: `workers` sandboxes stay up (numpy/sympy optionally preloaded); each
call forks a fresh child from the server, and everything the call made
(processes, files in scratch, /tmp, /dev/shm) is gone before the next.
strict: a fresh sandbox per call, closed before the call returns; the next
one is started in the background meanwhile (a spare per worker), so a call
waits for a sandbox's start-up only when calls come faster than sandboxes
start.
`PlainRunner` ('unsafe_subprocess') is the unconfined `python -c` baseline.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import marshal
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from absl import logging

from sao_jax.sandbox import cgroup as cgroup_lib
from sao_jax.sandbox import inside
from sao_jax.sandbox import launcher
from sao_jax.sandbox.limits import CallResult
from sao_jax.sandbox.limits import Limits
from sao_jax.sandbox.probe import choose_mechanism

_GRACE_S = 3.0  # Past the call's wall limit: the server's own clean-up.
# What a started sandbox may not hold (its `isolation` says), in words.
_GAPS = {
    "per_call_namespaces": "a pid and IPC namespace per call (no user "
                           "namespaces here): IPC is denied instead, and a "
                           "call can signal its server, which is then "
                           "replaced",
    "pristine_server": "a server that never holds a call's code (each call "
                       "is forked from the server that read the last one)",
    "scratch_size": "the scratch size limit (no tmpfs could be mounted: "
                    "RLIMIT_FSIZE bounds each file, not their sum)",
}
_LANDLOCK_GAPS = ("a network namespace (socket() is denied instead)",
                  "a mount namespace (Landlock limits what it may open)")
START_TIMEOUT_S = 30.0
# `SandboxPool` modes (module docstring; config.env.code_mode).
MODES = ("warm", "strict")


class SandboxError(RuntimeError):
  """A sandbox failed to start."""


class Sandbox:
  """One sandboxed server process (bwrap or landlock); not thread-safe."""

  def __init__(self, mechanism: str, limits: Limits,
               preload: tuple[str, ...] = (), slot: int | None = None,
               namespaces: bool = True, packages: bool = True):
    self.mechanism = mechanism
    self.namespaces = namespaces
    self.packages = packages
    self.limits = limits
    self.preload = preload
    self.slot = launcher.new_slot() if slot is None else slot
    self.preloaded: list[str] = []
    self.isolation: dict[str, bool] = {}
    self._launched: launcher.Launched | None = None

  @property
  def started(self) -> bool:
    return self._launched is not None

  def gaps(self) -> list[str]:
    """What this started sandbox does not hold that bwrap's holds."""
    out = [text for key, text in _GAPS.items()
           if not self.isolation.get(key, True)]
    return out + list(_LANDLOCK_GAPS if self.mechanism == "landlock" else ())

  @property
  def uid(self) -> int | None:
    return self._launched.uid if self._launched else None

  def start(self) -> None:
    cg = cgroup_lib.Cgroup.create(self.limits.total_memory_mb,
                                  self.limits.processes)
    try:
      self._launched = launcher.launch(self.mechanism, self.limits,
                                       self.preload, self.slot, cg,
                                       self.namespaces, self.packages)
      ready = self._recv(time.monotonic() + START_TIMEOUT_S)
    except BaseException:
      self.close()
      raise
    if not ready or "error" in ready:
      why = (ready or {}).get("error") or self._launched.stderr_tail().strip()
      self.close()
      raise SandboxError(
          f"the {self.mechanism} sandbox did not start: "
          f"{why or 'its server exited without a word'}. The interpreter "
          f"{sys.executable} and its prefixes must be readable there "
          "(probe.py names what this machine lacks).")
    self.preloaded = ready["preloaded"]
    self.isolation = dict(ready.get("isolation", {}),
                          scratch_size=self.mechanism == "bwrap" or
                          self._launched.scratch_mounted)

  def run(self, code: str) -> CallResult:
    """Runs `code` in a fresh child of the server."""
    if self._launched is None:
      self.start()
    proc = self._launched.proc
    ooms = self._launched.cgroup.oom_kills()
    data = marshal.dumps({"code": code})
    try:
      os.write(proc.stdin.fileno(), struct.pack(">I", len(data)) + data)
      reply = self._recv(time.monotonic() + self.limits.wall_s + _GRACE_S)
    except OSError:
      reply = None
    if reply is None:
      self.close()  # The next call starts a fresh one.
      return CallResult("", "", -1, timed_out=True,
                        sandbox_error="the sandbox stopped answering; "
                        "restarted")
    result = CallResult.from_dict(reply)
    if result.sandbox_error:  # Not the program's doing: a fresh sandbox.
      logging.warning("%s sandbox error: %s; restarting it.", self.mechanism,
                      result.sandbox_error)
      self.close()
    elif self._launched.cgroup.oom_kills() > ooms:  # The sum's bound hit.
      result = dataclasses.replace(result, memory_error=True)
    return result

  def _recv(self, deadline: float) -> dict | None:
    fd = self._launched.proc.stdout.fileno()
    head = _read_exact(fd, 4, deadline)
    if head is None:
      return None
    body = _read_exact(fd, struct.unpack(">I", head)[0], deadline)
    try:
      reply = None if body is None else json.loads(body)
    except ValueError:  # A garbled answer: treated as no answer.
      return None
    return reply if isinstance(reply, dict) else None

  def close(self) -> None:
    launched, self._launched = self._launched, None
    if launched is None:
      return
    proc = launched.proc
    inner = _children(proc.pid)  # bwrap's inner process: reaped below.
    # The server keeps no state worth a graceful exit: kill bwrap (its
    # inner processes die with it, --die-with-parent) or the fallback's
    # server, whose call leftovers are already gone.
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()
    if launched.uid is not None and self.mechanism == "landlock":
      _kill_uid(launched.uid)
    launched.release()
    launcher.reap_orphans(wait_for=inner)


class PlainRunner:
  """`python -c CODE` in a plain subprocess with a time-out: NO isolation.

  The baseline the security tests must defeat, and the benchmark's 'bare'.
  """

  mechanism = "unsafe_subprocess"

  def __init__(self, limits: Limits, close_fds: bool = True):
    self.limits = limits
    self.close_fds = close_fds  # False: as a runner that forks the host.

  def run(self, code: str) -> CallResult:
    t0 = time.monotonic()
    cap = self.limits.output_bytes
    try:
      proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            timeout=self.limits.wall_s, check=False,
                            close_fds=self.close_fds)
      out, err, rc, timed_out = proc.stdout, proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
      out, err, rc, timed_out = e.stdout or b"", e.stderr or b"", -9, True
    return CallResult(out[:cap].decode(errors="replace"),
                      err[:cap].decode(errors="replace"), rc,
                      timed_out=timed_out,
                      truncated=max(len(out), len(err)) > cap,
                      exec_s=time.monotonic() - t0)

  def close(self) -> None:
    pass


class SandboxStats:
  """Counters of a pool (the code tool's metrics, docs/design/sandbox.md "Code
  tool")."""

  def __init__(self, window: int = 4096):
    self._lock = threading.Lock()
    self.exec_s: collections.deque[float] = collections.deque(maxlen=window)
    self.counts = collections.Counter()

  def record(self, r: CallResult) -> None:
    with self._lock:
      self.exec_s.append(r.exec_s)
      self.counts["calls"] += 1
      self.counts["timeouts"] += int(r.timed_out)
      self.counts["memory_kills"] += int(r.memory_error)
      self.counts["truncations"] += int(r.truncated)
      self.counts["sandbox_errors"] += int(bool(r.sandbox_error))


class SandboxPool:
  """Thread-safe pool: `run(code)` on whichever worker is free.

  Args:
    limits: per-call bounds.
    workers: warm sandboxes kept up (warm mode); strict mode: at most this
      many fresh sandboxes at once.
    mode: 'warm' or 'strict'.
    mechanism: 'auto', 'bwrap', 'landlock' or 'unsafe_subprocess'.
    preload: modules the warm servers import once (e.g. numpy, sympy).
    namespaces: False runs each call without its own user, pid and IPC
      namespaces even where the kernel has them (as on machines without
      user namespaces; for tests).
    packages: False gives the calls the standard library only, not the
      venv's packages (graders: the task data lives there).
  """

  def __init__(self, limits: Limits | None = None, workers: int = 1,
               mode: str = "warm", mechanism: str = "auto",
               preload: tuple[str, ...] = (), namespaces: bool = True,
               packages: bool = True):
    if mode not in MODES:
      raise ValueError(f"sandbox mode {mode!r}: use one of {MODES}.")
    if workers < 1:
      raise ValueError(f"sandbox workers={workers} must be >= 1.")
    self.limits = limits or Limits()
    self.mode = mode
    self.mechanism = choose_mechanism(mechanism)
    self.stats = SandboxStats()
    self._idle: queue.Queue = queue.Queue()
    self._all = []
    # Every sandbox starts in one long-lived thread, whatever thread asks:
    # bwrap's --die-with-parent follows the thread that forked it.
    self._to_start: queue.Queue = queue.Queue()
    self._starter: threading.Thread | None = None
    self._pending = 0
    self._start_errors: list[Exception] = []
    self._lock = threading.Lock()
    self._started = threading.Condition(self._lock)
    for _ in range(workers):
      if self.mechanism == "unsafe_subprocess":
        worker = PlainRunner(self.limits)
        self._idle.put(worker)
      else:
        worker = Sandbox(self.mechanism, self.limits,
                         preload if mode == "warm" else (),
                         namespaces=namespaces, packages=packages)
        self._start(worker)
      self._all.append(worker)
    self._wait_for_starts()
    if self._start_errors:
      self.close()
      raise self._start_errors[0]
    gaps = sorted({g for w in self._all if isinstance(w, Sandbox)
                   for g in w.gaps()})
    if gaps:
      logging.warning("The %s sandbox does not hold: %s "
                      "(docs/design/sandbox.md).",
                      self.mechanism, "; ".join(gaps))

  def run(self, code: str) -> CallResult:
    worker = self._idle.get()
    try:
      result = worker.run(code)
    finally:
      if not isinstance(worker, Sandbox):
        self._idle.put(worker)
      elif self.mode == "strict":
        worker.close()  # Everything the call started is gone on return.
        self._start(worker)  # A fresh spare, while the caller goes on.
      elif not worker.started:
        self._start(worker)  # It stopped answering and closed itself.
      else:
        self._idle.put(worker)
    self.stats.record(result)
    return result

  def _start(self, worker: Sandbox) -> None:
    """Has the starter thread start `worker`, then hand it out."""
    with self._lock:
      if self._starter is None:
        self._starter = threading.Thread(target=self._starter_loop,
                                         daemon=True, name="sandbox-starter")
        self._starter.start()
      self._pending += 1
    self._to_start.put(worker)

  def _starter_loop(self) -> None:
    while (worker := self._to_start.get()) is not None:
      try:
        worker.start()
      except Exception as e:  # pylint: disable=broad-except
        # Handed out unstarted: its next call starts it and raises there.
        logging.warning("A %s sandbox did not start: %s", self.mechanism, e)
        self._start_errors.append(e)
      with self._lock:
        self._pending -= 1
        self._started.notify_all()
      self._idle.put(worker)

  def _wait_for_starts(self) -> None:
    with self._lock:
      self._started.wait_for(lambda: self._pending == 0)

  @property
  def workers(self) -> list:
    return list(self._all)

  def leftovers(self) -> list[int] | None:
    """Host pids of processes of this pool's sandboxes other than the warm
    servers (None when not root: the sandboxes then share this uid)."""
    if self.mechanism == "unsafe_subprocess" or os.getuid() != 0:
      return None
    self._wait_for_starts()  # A starting sandbox is not a leftover.
    uids = {launcher.sandbox_uid(w.slot) for w in self._all}
    mine = {p: launcher.proc_status(p) for p in _all_pids()
            if _uid(p) in uids}
    # The servers (whose parent is not of a sandbox uid), and the processes
    # that make or are a call server (named so by inside.py from their
    # first instruction on).
    return sorted(p for p, status in mine.items()
                  if int(status.get("PPid", "0")) in mine and
                  status.get("Name", "").encode() not in (
                      inside.SPAWN_NAME, inside.CALL_NAME))

  def close(self) -> None:
    self._wait_for_starts()
    if self._starter is not None:
      self._to_start.put(None)
      self._starter.join()
      self._starter = None
    for worker in self._all:
      worker.close()

  def __enter__(self) -> "SandboxPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
  buf = b""
  while len(buf) < n:
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
      return None
    chunk = os.read(fd, n - len(buf))
    if not chunk:
      return None
    buf += chunk
  return buf


def _all_pids() -> list[int]:
  return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _children(pid: int) -> list[int]:
  out = []
  for task in glob.glob(f"/proc/{pid}/task/*/children"):
    try:
      with open(task) as f:
        out += [int(p) for p in f.read().split()]
    except OSError:
      pass
  return out


def _uid(pid: int) -> int | None:
  try:
    return os.stat(f"/proc/{pid}").st_uid
  except OSError:
    return None


def _kill_uid(uid: int) -> None:
  """SIGKILLs what is left of a fallback sandbox (its uid is its own)."""
  for pid in _all_pids():
    if _uid(pid) == uid:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
