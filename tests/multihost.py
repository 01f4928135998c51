"""Helpers of the multi-process (multi-host on localhost) tests."""

import os
import socket
import subprocess
import sys
from typing import Any

# tests/: where the helper modules a test file imports (this one among them)
# live, wherever in tests/ the test file itself is.
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
  """A TCP port on localhost that was free a moment ago (the coordinator's)."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def run_as_main(test_file: str, *args: Any, devices: int,
                **popen_kwargs: Any) -> subprocess.Popen:
  """Starts ``test_file``'s ``__main__`` on ``devices`` fake CPU devices.

  The child imports the same helper modules as the test (``tests/`` on its
  ``PYTHONPATH``); ``popen_kwargs`` go to `subprocess.Popen` (its output).
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      f" --xla_force_host_platform_device_count={devices}")
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (TESTS_DIR, env.get("PYTHONPATH", "")) if p)
  return subprocess.Popen([sys.executable, test_file, *map(str, args)],
                          env=env, **popen_kwargs)
