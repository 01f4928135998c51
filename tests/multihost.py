"""Helpers of the multi-process (multi-host on localhost) tests."""

import socket


def free_port() -> int:
  """A TCP port on localhost that was free a moment ago (the coordinator's)."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]
