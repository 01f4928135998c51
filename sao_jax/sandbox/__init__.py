"""A sandbox for untrusted Python (docs/design/sandbox.md "Code sandbox").

  from sao_jax.sandbox import Limits, SandboxPool
  with SandboxPool(Limits(), workers=2, mode="warm") as pool:
    result = pool.run("print(1 + 1)")   # CallResult(stdout='2\\n', ...)

Mechanisms (chosen by `probe.choose_mechanism`, reported in `pool.mechanism`):
'bwrap' (namespaces + seccomp + rlimits + memory cgroup), 'landlock'
(Landlock + seccomp + rlimits + an unprivileged uid) and, only on request,
'unsafe_subprocess' (a plain `python -c`, no isolation at all).
"""

from sao_jax.sandbox.limits import CallResult
from sao_jax.sandbox.limits import Limits
from sao_jax.sandbox.pool import SandboxPool
from sao_jax.sandbox.probe import SandboxUnavailable
from sao_jax.sandbox.probe import choose_mechanism

__all__ = ["CallResult", "Limits", "SandboxPool", "SandboxUnavailable",
           "choose_mechanism"]
