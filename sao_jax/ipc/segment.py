"""Named POSIX shared-memory segments with strict ownership and cleanup.

One concern: the lifetime of a ``multiprocessing.shared_memory`` segment.

* The **creator** owns the segment. It is created with mode 0600 (private to the
  user) and unlinked on every exit path of the creator: ``close()``, leaving a
  ``with`` block (also on exception), interpreter exit (``atexit``) and SIGTERM
  (a handler that unlinks, then chains to the previous handler). SIGKILL cannot
  be caught; the creator's ``multiprocessing`` resource tracker then unlinks it,
  unless it was killed too (a whole process group SIGKILLed): then the next
  process that creates a segment removes it (``reap_orphans``: our names whose
  creator pid is no longer alive; not with ``SAO_KEEP_ORPHANS=1``, which the
  tests set so that their leak check sees every leak).
* **Attachers** never unlink and never register the segment with their resource
  tracker. (Before Python 3.13 ``SharedMemory(create=False)`` registers it, so
  an attaching process' tracker would unlink it when that process exits; with
  ``spawn`` children sharing the parent's tracker, a later ``unregister`` would
  drop the *creator's* registration instead. We therefore suppress the
  registration while attaching.)

This module holds the process's one SIGTERM handler. Inside
``sigterm_unwinds()`` (the trainer's loop) SIGTERM, after unlinking, raises
``KeyboardInterrupt`` in the main thread instead, so every ``finally`` runs
(the sampler is stopped, the checkpointer closed); inside
``sigterm_deferred()`` (a train step and the assignment of its result, whose
input buffers are donated) it is raised when that block ends.

Python runs signal handlers in the main thread between bytecodes, so the
SIGTERM cleanup waits until the main thread returns from a blocking C call.

Segment names carry the prefix ``sao_`` so leaks are easy to find in /dev/shm.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing import shared_memory
from typing import Any

from absl import logging

PREFIX = "sao_"
_MODE = 0o600
# Exactly what ``make_name`` writes: other programs' ``sao_*`` files differ.
_NAME_RE = re.compile(rf"^{PREFIX}([A-Za-z0-9]+)_([0-9]+)_([0-9a-f]{{8}})$")

_lock = threading.RLock()
_reaped = False  # reap_orphans ran in this process (at its first create).
# Set to 1, leftovers stay (the test suite's leak check must see them all).
KEEP_ORPHANS_ENV = "SAO_KEEP_ORPHANS"
_owned: dict[str, shared_memory.SharedMemory] = {}
_handlers_installed = False
_prev_sigterm: Any = None
_unwind_depth = 0  # > 0 inside sigterm_unwinds().
_defer_depth = 0  # > 0 inside sigterm_deferred().
_pending_signal: int | None = None  # A SIGTERM that arrived while deferred.


def make_name(kind: str) -> str:
  """A fresh name ``sao_<kind>_<pid>_<random>`` (short: macOS caps at 31)."""
  return f"{PREFIX}{kind}_{os.getpid()}_{secrets.token_hex(4)}"


def creator_pid(name: str) -> int | None:
  """The creator's pid in a name ``make_name`` made; None for any other name
  (another program's ``/dev/shm/sao_*`` file is not ours to count)."""
  m = _NAME_RE.match(os.path.basename(name))
  return int(m.group(2)) if m else None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Another user's live process.
    return True
  return True


def reap_orphans(directory: str = "/dev/shm",
                 pattern: re.Pattern[str] = _NAME_RE, group: int = 2) -> int:
  """Removes this user's files (or directories) in ``directory`` whose name
  matches ``pattern`` and whose creator pid (the match's ``group``) is dead:
  what a SIGKILLed process group could not clean up. Returns how many."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:  # No /dev/shm (not Linux).
    return 0
  removed = 0
  for name in names:
    m = pattern.match(name)
    if not m or _alive(int(m.group(group))):
      continue
    path = os.path.join(directory, name)
    try:
      if os.lstat(path).st_uid != os.getuid():
        continue
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
      else:
        os.unlink(path)
      removed += 1
    except (FileNotFoundError, PermissionError):
      continue  # Another process reaped it first, or not ours to remove.
  if removed:
    logging.warning("Removed %d leftover %s entries of dead processes from "
                    "%s.", removed, pattern.pattern, directory)
  return removed


def shm_path(name: str) -> str:
  """Where Linux exposes the segment (for permission checks and leak checks)."""
  return os.path.join("/dev/shm", name.lstrip("/"))


def _unlink_quietly(shm: shared_memory.SharedMemory) -> None:
  try:
    shm.unlink()
  except FileNotFoundError:
    pass


def _unlink_all_owned() -> None:
  with _lock:
    owned = list(_owned.values())
    _owned.clear()
  for shm in owned:
    _unlink_quietly(shm)


def _on_sigterm(signum, frame) -> None:
  """Unlinks our segments, then unwinds or acts as the previous handler."""
  global _pending_signal
  _unlink_all_owned()
  if _unwind_depth and _defer_depth:
    _pending_signal = signum  # Raised when the deferred block ends.
    return
  if _unwind_depth:
    raise KeyboardInterrupt(f"signal {signum}")
  prev = _prev_sigterm
  if callable(prev):
    prev(signum, frame)
  elif prev == signal.SIG_IGN:
    return
  else:  # SIG_DFL or None (installed from C): die of SIGTERM as before.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
  global _handlers_installed, _prev_sigterm
  with _lock:
    if _handlers_installed:
      return
    _handlers_installed = True
    atexit.register(_unlink_all_owned)
    if threading.current_thread() is not threading.main_thread():
      logging.warning(
          "Shared-memory segment created off the main thread: no SIGTERM "
          "handler installed; it is still unlinked by close()/atexit."
      )
      return
    prev = signal.getsignal(signal.SIGTERM)
    if prev is _on_sigterm:
      return
    _prev_sigterm = prev
    signal.signal(signal.SIGTERM, _on_sigterm)


@contextlib.contextmanager
def sigterm_unwinds():
  """SIGTERM raises ``KeyboardInterrupt`` (after unlinking) inside the block.

  Must be entered on the main thread (where Python runs signal handlers).
  """
  global _unwind_depth, _prev_sigterm
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("segment.sigterm_unwinds() must run on the main thread "
                       "(Python delivers signals there).")
  _install_handlers()
  with _lock:
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:  # Someone replaced it since: chain to it.
      _prev_sigterm = current
      signal.signal(signal.SIGTERM, _on_sigterm)
  _unwind_depth += 1
  try:
    yield
  finally:
    _unwind_depth -= 1


def create(kind: str, size: int) -> shared_memory.SharedMemory:
  """Creates a private (0600) segment owned by this process."""
  if size <= 0:
    raise ValueError(f"Segment size must be positive, got {size}.")
  _install_handlers()
  global _reaped
  if not _reaped:
    _reaped = True
    if os.environ.get(KEEP_ORPHANS_ENV) != "1":
      reap_orphans()
  name = make_name(kind)
  shm = shared_memory.SharedMemory(name=name, create=True, size=size)
  fd = getattr(shm, "_fd", -1)
  try:
    if fd >= 0:
      os.fchmod(fd, _MODE)  # shm_open honours umask only downwards; enforce.
    elif os.path.exists(shm_path(shm.name)):
      os.chmod(shm_path(shm.name), _MODE)
  except OSError:
    _unlink_quietly(shm)
    shm.close()
    raise
  with _lock:
    _owned[shm.name] = shm
  return shm


@contextlib.contextmanager
def _untracked():
  """Suppresses resource-tracker registration (Python < 3.13 has no track=)."""
  with _lock:
    original = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
      yield
    finally:
      resource_tracker.register = original


def attach(name: str) -> shared_memory.SharedMemory:
  """Maps an existing segment without taking ownership (never unlinks it)."""
  try:
    if sys.version_info >= (3, 13):
      return shared_memory.SharedMemory(  # pytype: disable=wrong-keyword-args
          name=name, track=False)
    with _untracked():
      return shared_memory.SharedMemory(name=name)
  except FileNotFoundError as e:
    raise FileNotFoundError(
        f"Shared-memory segment {name!r} does not exist: the creating process "
        "has exited or closed it, or the name is wrong."
    ) from e


def release(shm: shared_memory.SharedMemory, *, unlink: bool) -> None:
  """Closes the mapping; unlinks too if ``unlink`` (creator only)."""
  if unlink:
    with _lock:
      _owned.pop(shm.name, None)
    _unlink_quietly(shm)
  try:
    shm.close()
  except BufferError:
    # NumPy views of the mapping are still alive (e.g. held by a traceback).
    # Drop our references instead: the mapping is unmapped when the last view
    # goes, and SharedMemory.__del__ has nothing left to close noisily.
    shm._buf = None  # pylint: disable=protected-access
    shm._mmap = None  # pylint: disable=protected-access
    fd = getattr(shm, "_fd", -1)
    if fd >= 0:
      os.close(fd)
      shm._fd = -1  # pylint: disable=protected-access
    logging.info("Segment %s detached with live views; unmapped when they go.",
                 shm.name)


@contextlib.contextmanager
def sigterm_deferred():
  """Inside ``sigterm_unwinds()``: SIGTERM unwinds only when this block ends.

  For work that must not be split, such as a jitted step that donates the
  state it replaces: interrupted between the call and the assignment, neither
  the old state (donated) nor the new one would be left to checkpoint.
  """
  global _defer_depth, _pending_signal
  _defer_depth += 1
  try:
    yield
  finally:
    _defer_depth -= 1
    signum = None
    if not _defer_depth:
      signum, _pending_signal = _pending_signal, None
  if signum is not None:
    raise KeyboardInterrupt(f"signal {signum}")
