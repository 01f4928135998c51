"""Suite-wide fixtures: no shared-memory segment of ours outlives the tests."""

import os

import pytest

# sao_jax.ipc.segment.PREFIX, spelled out so that this conftest (part of every
# test target) needs no dependency on the package.
_PREFIX = "sao_"


def _our_segments() -> set[str]:
  try:
    return {n for n in os.listdir("/dev/shm") if n.startswith(_PREFIX)}
  except FileNotFoundError:  # Not Linux: nothing to check.
    return set()


def _creator_pid(name: str) -> int:
  """The pid in ``sao_<kind>_<pid>_<random>`` (segment.make_name), or -1."""
  try:
    return int(name.split("_")[-2])
  except (IndexError, ValueError):
    return -1


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
  """Fails the session if a ``sao_`` segment created during it remains.

  Counted: segments created by this process, or by a process that has exited
  (e.g. a test's child). Segments of other live processes (another test run
  sharing the machine) are theirs to clean up.
  """
  before = _our_segments()
  yield
  leaked = sorted(
      n for n in _our_segments() - before
      if _creator_pid(n) == os.getpid() or not _alive(_creator_pid(n)))
  if leaked:
    pytest.fail(
        f"Shared-memory segments leaked in /dev/shm: {leaked}. Close rings and "
        "weight slots (use `with`), and never SIGKILL their creator in tests.",
        pytrace=False,
    )
