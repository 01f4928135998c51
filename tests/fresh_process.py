"""Runs a test body in a fresh interpreter, so libtpu never loads in pytest's.

With the ``tpu`` extra installed, libtpu is a second XLA (with its own
compiler) in the process that loads it. The suite keeps it out of the pytest
process (conftest.py sets ``JAX_PLATFORMS=cpu``): what needs TPU
compile-only devices runs here, one child process per call, and its
assertions fail the calling test with the child's traceback.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from sao_jax import tpu_topology

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
# What a process that compiles for TPUs runs with: libtpu as
# sao_jax.tpu_topology sets it up, and XLA's full optimisation (the suite
# turns most of it off for CPU programs, conftest.py), since the tests assert
# the memory figures of these compiles.
TPU_ENV = {**tpu_topology.LIBTPU_ENV, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"}


def run(module: str, function: str, *args: str, timeout: float = 900) -> str:
  """Calls ``tests/<module>.py``'s ``function(*args)`` in a child; its stdout.

  Raises AssertionError with the child's stderr tail if it exits non-zero.
  """
  code = (f"import sys; sys.path[:0] = [{_TESTS!r}, {_ROOT!r}]; "
          f"import {module}; {module}.{function}(*sys.argv[1:])")
  env = dict(os.environ, PYTHONPATH=_ROOT, **TPU_ENV)
  got = subprocess.run([sys.executable, "-c", code, *args], cwd=_ROOT,
                       env=env, capture_output=True, text=True,
                       timeout=timeout, check=False)
  assert got.returncode == 0, (
      f"{module}.{function} failed in its own process (exit "
      f"{got.returncode}):\n{got.stderr[-6000:]}")
  return got.stdout


@functools.cache
def libtpu_available() -> tuple[bool, str]:
  """`tpu_topology.libtpu_available()`, asked of a child process."""
  code = ("import json; from sao_jax import tpu_topology as t; "
          "print(json.dumps(t.libtpu_available()))")
  env = dict(os.environ, PYTHONPATH=_ROOT, **TPU_ENV)
  got = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, env=env,
                       capture_output=True, text=True, timeout=300,
                       check=False)
  if got.returncode != 0:
    return False, f"the libtpu probe exited {got.returncode}: " + (
        got.stderr.strip().splitlines() or [""])[-1]
  ok, why = json.loads(got.stdout.strip().splitlines()[-1])
  return bool(ok), why


def aot(*flags: str, timeout: float = 900) -> tuple[
    subprocess.CompletedProcess, dict[str, dict]]:
  """Runs ``python -m sao_jax.aot *flags`` in a child with libtpu; the
  finished process and its JSON reports by program."""
  env = dict(os.environ, PYTHONPATH=_ROOT, **TPU_ENV)
  got = subprocess.run([sys.executable, "-m", "sao_jax.aot", *flags],
                       cwd=_ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout, check=False)
  reports = {r["program"]: r for r in map(json.loads, (
      l for l in got.stdout.splitlines() if l.startswith("{")))}
  return got, reports
