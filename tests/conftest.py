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


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
  """Fails the session if a ``sao_`` segment created during it remains."""
  before = _our_segments()
  yield
  leaked = sorted(_our_segments() - before)
  if leaked:
    pytest.fail(
        f"Shared-memory segments leaked in /dev/shm: {leaked}. Close rings and "
        "weight slots (use `with`), and never SIGKILL their creator in tests.",
        pytrace=False,
    )
