"""Which sandbox mechanism this machine supports (docs/design/sandbox.md
"Mechanisms"): 'auto' is bwrap or a refusal; the Landlock fallback,
which holds fewer guarantees (the threat table of docs/design/sandbox.md), only
when asked for by name."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess

MECHANISMS = ("auto", "bwrap", "landlock", "unsafe_subprocess")
OVERRIDE_FLAG = "--config.env.code_sandbox=unsafe_subprocess"
FALLBACK_FLAG = "--config.env.code_sandbox=landlock"
_LANDLOCK_CREATE_RULESET = 444  # The same number on x86_64 and aarch64.


class SandboxUnavailable(RuntimeError):
  """No mechanism that confines untrusted code works on this machine."""


@functools.lru_cache(maxsize=None)
def landlock_abi() -> int:
  """The kernel's Landlock ABI version; 0 when Landlock is off."""
  libc = ctypes.CDLL(None, use_errno=True)
  abi = libc.syscall(_LANDLOCK_CREATE_RULESET, None, 0, 1)
  return max(abi, 0)


@functools.lru_cache(maxsize=None)
def seccomp_problem() -> str:
  """'' if a seccomp filter can be compiled here, else why not."""
  try:
    from sao_jax.sandbox import seccomp_policy  # pylint: disable=g-import-not-at-top
    seccomp_policy.bpf_program()
  except (ImportError, OSError, RuntimeError) as e:
    return (f"seccomp: libseccomp or its Python bindings are missing ({e}); "
            "pip install pyseccomp and apt-get install libseccomp2")
  return ""


@functools.lru_cache(maxsize=None)
def bwrap_problem() -> str:
  """'' if bubblewrap can make a sandbox here, else why not."""
  path = shutil.which("bwrap")
  if not path:
    return "bwrap: not installed (apt-get install bubblewrap)"
  args = [path, "--unshare-pid", "--unshare-net", "--die-with-parent",
          "--ro-bind", "/", "/", "true"]
  if os.getuid() != 0:
    args.insert(1, "--unshare-user")
  try:
    proc = subprocess.run(args, capture_output=True, timeout=10, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"bwrap: cannot run ({e})"
  if proc.returncode != 0:
    return ("bwrap: cannot create namespaces (unprivileged user namespaces "
            "disabled? sysctl kernel.unprivileged_userns_clone=1 / "
            f"user.max_user_namespaces): {proc.stderr.decode()[-200:]!r}")
  return ""


def landlock_problem() -> str:
  """'' if the Landlock fallback can confine here, else why not."""
  abi = landlock_abi()
  if abi < 1:
    return "landlock: not enabled in this kernel (CONFIG_SECURITY_LANDLOCK, lsm=)"
  if os.getuid() != 0 and abi < 6:
    return (f"landlock: ABI {abi} < 6 cannot scope signals, and without root "
            "there is no unprivileged uid to run the code as")
  return ""


def choose_mechanism(requested: str = "auto") -> str:
  """The mechanism to use for `requested` (one of MECHANISMS).

  'auto' takes bwrap only: where it cannot run, the refusal says whether
  the Landlock fallback would, so that the weaker mechanism is a choice
  made in the config, never a silent one.

  Raises:
    SandboxUnavailable: naming what is missing and the flags that override.
  """
  if requested not in MECHANISMS:
    raise ValueError(f"sandbox mechanism {requested!r}: use one of "
                     f"{MECHANISMS}.")
  if requested == "unsafe_subprocess":
    return requested
  problems = []
  if seccomp_problem():
    problems.append(seccomp_problem())
  else:
    for name, problem in (("bwrap", bwrap_problem),
                          ("landlock", landlock_problem)):
      if requested == name and not problem():
        return name
      if requested == "auto" and name == "bwrap" and not problem():
        return name
      if requested in ("auto", name):
        problems.append(problem() or (
            "landlock: available, but it holds fewer guarantees than bwrap "
            f"(docs/design/sandbox.md); ask for it with {FALLBACK_FLAG}"))
  raise SandboxUnavailable(
      f"no sandbox for untrusted code ({requested!r} requested): "
      + "; ".join(problems) + ". Install what is missing, or run the code "
      f"without any isolation with {OVERRIDE_FLAG} (never with a policy's "
      "code on a machine that matters).")
