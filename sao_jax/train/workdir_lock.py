"""One run per workdir: an exclusive lock on ``<workdir>/run.lock``.

docs/design/failures.md ("a second run on a workdir in use"). A
run takes the lock before any compute and holds it to the end; a second run on
the same workdir refuses at once with ``WorkdirInUseError`` naming the holder
(host, pid, start time, command) and what to do.

* The lock is ``flock(LOCK_EX | LOCK_NB)`` on the file: the kernel releases it
  when its holder exits, SIGKILL included, so a killed run never blocks its
  resume. Linux's NFS client maps flock onto NFS byte-range locks, so hosts
  sharing an NFS workdir exclude each other too.
* The file holds the holder's record (JSON), for the refusal's message only;
  it stays behind after a run (a stale record is overwritten by the next).
* A multi-host run is one run: process 0 takes the lock and every process
  learns the outcome (one tiny all-gather), so all of a second run's
  processes refuse together instead of hanging in their first collective.
* Where the filesystem has no flock (``ENOLCK``, ``EOPNOTSUPP``) the record
  decides: a holder on this host counts while its pid (and start time) lives;
  one on another host counts until it releases (then delete the file by hand
  if that run was killed); a warning says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from typing import Any

from absl import logging

from sao_jax.ipc import ring_segment

LOCK_NAME = "run.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class WorkdirInUseError(RuntimeError):
  """Another run holds the workdir's lock."""


def holder_record() -> dict[str, Any]:
  """This process as a lock holder: host, pid (and its start ticks), UTC start
  time and command line."""
  return {
      "host": socket.gethostname(), "pid": os.getpid(),
      "pid_start_ticks": ring_segment.proc_start_time(os.getpid()),
      "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      "command": " ".join(sys.argv), "released": False,
  }


def read_record(path: str) -> dict[str, Any] | None:
  """The record in a lock file; None if missing, empty or being written."""
  try:
    with open(path, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def describe(record: dict[str, Any] | None) -> str:
  if not record:
    return "a run that has not written its record yet"
  return (f"pid {record.get('pid')} on host {record.get('host')}, started "
          f"{record.get('started')} (command: {record.get('command')})")


def _refusal(workdir: str, record: dict[str, Any] | None) -> WorkdirInUseError:
  return WorkdirInUseError(
      f"Workdir {workdir} is in use by another run: {describe(record)}. Two "
      "runs on one workdir would write the same checkpoints, events and "
      "summary. Wait for it to finish, stop it (SIGTERM saves its last step; "
      "then run again to resume), or pass another --workdir. A run that was "
      "killed holds no lock: running again resumes it.")


def _record_holds(record: dict[str, Any] | None) -> bool:
  """Without flock: whether a record still names a live holder."""
  if not record or record.get("released"):
    return False
  if record.get("host") != socket.gethostname():
    return True  # Cannot check another host's pids.
  return ring_segment.pid_alive(int(record.get("pid", 0)),
                                int(record.get("pid_start_ticks", 0)))


@dataclasses.dataclass
class WorkdirLock:
  """A held lock (``fd`` is None on other processes of a multi-host run)."""

  workdir: str
  path: str
  fd: int | None

  def release(self) -> None:
    """Marks the record released and drops the lock; idempotent."""
    if self.fd is None:
      return
    fd, self.fd = self.fd, None
    try:
      record = read_record(self.path) or {}
      _write(fd, {**record, "released": True})
    except OSError as e:
      logging.warning("Could not mark %s released: %s", self.path, e)
    finally:
      os.close(fd)  # Closing drops the flock.


def _write(fd: int, record: dict[str, Any]) -> None:
  data = json.dumps(record).encode()
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)
  os.fsync(fd)


def _take(workdir: str, path: str) -> tuple[int | None, str]:
  """(fd, '') with the lock taken, or (None, why not)."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    return None, str(_refusal(workdir, read_record(path)))
  except OSError as e:
    if e.errno not in _NO_FLOCK:
      os.close(fd)
      raise
    logging.warning(
        "%s: the filesystem has no flock (%s); relying on the lock file's "
        "record, which cannot tell a killed run on another host from a live "
        "one (delete the file if you know its run is gone).", path, e)
    if _record_holds(read_record(path)):
      os.close(fd)
      return None, str(_refusal(workdir, read_record(path)))
  _write(fd, holder_record())
  return fd, ""


def acquire(workdir: str, process_index: int | None = None,
            process_count: int | None = None) -> WorkdirLock:
  """Creates ``workdir`` and takes its lock (process 0 of a multi-host run,
  the outcome shared with all; see the module docstring).

  Raises:
    WorkdirInUseError: another run holds it.
  """
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top
    process_index, process_count = jax.process_index(), jax.process_count()
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOCK_NAME)
  fd, why = _take(workdir, path) if process_index == 0 else (None, "")
  if process_count > 1:
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    refused = np.asarray(multihost_utils.process_allgather(
        np.int32(bool(why))))
    if refused.any() and not why:
      why = (f"Process 0 of this run could not lock {path}: another run "
             "holds the workdir (process 0's error names it).")
  if why:
    raise WorkdirInUseError(why)
  logging.info("Holding %s (one run per workdir).", path)
  return WorkdirLock(workdir, path, fd)
