"""Sandbox pools for the sandbox tests, made once per kind and module.

A kind is `MECHANISM[_MODE][_no_ns]`: `bwrap_warm`, `bwrap_strict`,
`landlock_warm`, `bwrap_no_ns` (warm, no per-call namespaces) ...; `plain`
is `PlainRunner`, the unconfined baseline. A mechanism this machine lacks
skips the test, except bwrap under CI, which installs bubblewrap.
"""

import os

import pytest

from sao_jax.sandbox import probe
from sao_jax.sandbox.pool import PlainRunner
from sao_jax.sandbox.pool import SandboxPool


def make(kind, limits):
  """A new pool (or `PlainRunner`) of `kind`, or a skip."""
  if kind == "plain":
    return PlainRunner(limits)
  mechanism = kind.split("_")[0]
  problem = (probe.bwrap_problem() if mechanism == "bwrap"
             else probe.landlock_problem()) or probe.seccomp_problem()
  if problem and not (os.environ.get("CI") and mechanism == "bwrap"):
    pytest.skip(problem)  # CI installs bubblewrap: there it must work.
  return SandboxPool(limits, workers=1,
                     mode="strict" if "_strict" in kind else "warm",
                     mechanism=mechanism, namespaces="_no_ns" not in kind)


class Cache:
  """One pool per kind, closed together (a module fixture's teardown)."""

  def __init__(self, limits):
    self.limits = limits
    self._pools = {}

  def get(self, kind):
    if kind not in self._pools:
      self._pools[kind] = make(kind, self.limits)
    return self._pools[kind]

  def close(self):
    for p in self._pools.values():
      p.close()
    self._pools.clear()


def grading_pool(wall_s=3.0):
  """A grading pool (standard library only) with a shorter wall than
  grading's own, for the calls that hang; bwrap, or a skip."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from sao_jax.grading import functions  # pylint: disable=g-import-not-at-top

  problem = probe.bwrap_problem() or probe.seccomp_problem()
  if problem and not os.environ.get("CI"):
    pytest.skip(problem)
  return functions.make_pool("bwrap", limits=dataclasses.replace(
      functions.LIMITS, wall_s=wall_s, cpu_s=int(wall_s)))
