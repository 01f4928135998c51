"""Starts one sandboxed interpreter (`inside.py`) with the chosen mechanism
(docs/design/sandbox.md "Host-side traps handled").

bwrap: new pid, net, ipc, uts and cgroup namespaces (and a user namespace
when not root); the system's /usr and the interpreter's prefixes read-only
(each bound at the path this process sees it by, so a venv behind a symlink
or under /tmp works), a minimal /etc (alternatives for numpy's BLAS, the
loader cache), private size-limited tmpfs /scratch, /tmp and /dev/shm;
capabilities dropped (as root only CAP_SETUID/SETGID stay, for the server to
drop to its own uid). landlock: the same interpreter run directly, confining
itself (inside.py) with Landlock to read-only system paths and a private
scratch directory (a size-limited tmpfs where this process may mount one),
and its own uid. Either way the seccomp filter is loaded by each call's
process (inside.py), after the server has made the call's namespaces.

Two host-side traps are handled here: bwrap's inner process outlives the
outer one and is re-parented to init, which on some machines never reaps
(zombies until `bwrap: Can't fork`), so this process becomes a child
subreaper and `reap_orphans` reaps them; and RLIMIT_NPROC does not bind
root, so as root every sandbox runs as its own unprivileged uid.
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import marshal
import os
import shutil
import site
import stat
import subprocess
import sys
import tempfile
import threading
from typing import Any, Sequence

from sao_jax.sandbox import cgroup as cgroup_lib
from sao_jax.sandbox import seccomp_policy
from sao_jax.sandbox.limits import Limits

UID_BASE = 1_000_000_000  # Sandbox uids: UID_BASE + (pid << 8 | slot).
_INSIDE_SOURCE = None
_SUBREAPER_LOCK = threading.Lock()
_SUBREAPER = False
_ETC = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf",
        "/etc/ld.so.conf.d", "/etc/localtime")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1"}


_SLOTS = itertools.count()


def new_slot() -> int:
  """A slot number no other sandbox of this process has (mod 256)."""
  return next(_SLOTS) & 0xFF


def sandbox_uid(slot: int) -> int:
  """A uid of its own for sandbox `slot` of this process (root only)."""
  return UID_BASE + (((os.getpid() & 0x3FFFFF) << 8) | slot)


# The -c program: confine.py as module `sao_sandbox_confine`, then inside.py
# as __main__, both handed over as arguments (the sandbox cannot see the
# repository); inside.py's argv is then [-c, config].
_BOOT = ("import sys, types\n"
         "m = types.ModuleType('sao_sandbox_confine')\n"
         "exec(compile(sys.argv[1], 'confine.py', 'exec'), m.__dict__)\n"
         "sys.modules[m.__name__] = m\n"
         "src = sys.argv[2]\n"
         "del sys.argv[1:3]\n"
         "exec(compile(src, 'inside.py', 'exec'), {'__name__': '__main__'})\n")


# sh -c's script: writes 0 (itself) into each cgroup.procs given before
# "--", then execs the rest; a cgroup it cannot join ends the launch.
_JOIN_THEN_EXEC = (
    'while [ "$1" != -- ]; do echo 0 > "$1" || { echo "sao sandbox: cannot '
    'join cgroup $1" >&2; exit 126; }; shift; done; shift; exec "$@"')


def _inside_source() -> list[str]:
  """The sources the sandbox's interpreter runs (read once)."""
  global _INSIDE_SOURCE
  if _INSIDE_SOURCE is None:
    here = os.path.dirname(__file__)
    _INSIDE_SOURCE = []
    for name in ("confine.py", "inside.py"):
      with open(os.path.join(here, name)) as f:
        _INSIDE_SOURCE.append(f.read())
  return _INSIDE_SOURCE


def ensure_subreaper() -> None:
  """Makes this process the reaper of its descendants' orphans (once)."""
  global _SUBREAPER
  with _SUBREAPER_LOCK:
    if not _SUBREAPER:
      libc = ctypes.CDLL(None, use_errno=True)
      libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
      _SUBREAPER = True


def reap_orphans(keep: Sequence[int] = (), wait_for: Sequence[int] = ()
                 ) -> int:
  """Reaps adopted zombies that sandboxes left (bwrap's, or a sandbox
  uid's), never another child of this process; returns how many.

  `wait_for`: pids of a closed sandbox's inner processes, waited for first
  (re-parented here, they die with their parent bwrap).
  """
  reaped = 0
  for pid in wait_for:
    try:
      reaped += os.waitpid(pid, 0)[0] == pid
    except ChildProcessError:
      pass
  for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
    try:
      with open(path) as f:
        pids = [int(p) for p in f.read().split()]
    except OSError:
      continue
    for pid in pids:
      if pid in keep or not _is_sandbox_zombie(pid):
        continue
      try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
          reaped += 1
      except ChildProcessError:
        pass
  return reaped


def proc_status(pid: int) -> dict[str, str]:
  """/proc/PID/status as {field: value}; {} when the process is gone."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return {k: v.strip() for k, v in (
          line.split(":", 1) for line in f if ":" in line)}
  except OSError:
    return {}


def _is_sandbox_zombie(pid: int) -> bool:
  fields = proc_status(pid)
  if not fields:
    return False
  uid = int(fields.get("Uid", "0").split()[0])
  return fields.get("State", "").startswith("Z") and (
      fields.get("Name", "") == "bwrap" or uid >= UID_BASE)


def _accessible_to_others(path: str) -> bool:
  path = os.path.realpath(path)
  while path != "/":
    mode = os.stat(path).st_mode
    if not mode & (stat.S_IXOTH if stat.S_ISDIR(mode) else stat.S_IROTH):
      return False
    path = os.path.dirname(path)
  return True


def interpreter(mechanism: str, packages: bool = True
                ) -> tuple[str, list[tuple[str, str]]]:
  """(python to run, [(host directory, path inside)] it needs read-only
  besides /usr). A prefix reached through a symlink is bound at both paths.

  `packages=False`: the base interpreter and its standard library only, not
  the venv (whose site-packages hold, e.g., the task data a grader's
  candidate must not read).
  """
  exe = sys.executable if packages else os.path.realpath(sys.executable)
  if (mechanism == "landlock" and os.getuid() == 0 and
      not _accessible_to_others(exe) and os.path.exists("/usr/bin/python3")):
    return "/usr/bin/python3", []  # The sandbox uid cannot read the venv's.
  binds = {}
  paths = (sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(
      os.path.abspath(exe))), os.path.dirname(os.path.dirname(
          os.path.realpath(exe)))) if packages else (
              sys.base_prefix, os.path.dirname(os.path.dirname(exe)))
  for path in paths:
    real = os.path.realpath(path)
    for inside in (os.path.abspath(path), real):
      if inside != "/usr" and not inside.startswith("/usr/"):
        binds[inside] = real
  return exe, sorted((src, dst) for dst, src in binds.items())


def _bwrap_argv(limits: Limits, exe: str,
                prefixes: list[tuple[str, str]]) -> list[str]:
  root = os.getuid() == 0
  size = str(limits.scratch_mb << 20)
  argv = [shutil.which("bwrap") or "bwrap", "--unshare-pid", "--unshare-net",
          "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
          "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
  if not root:
    argv.append("--unshare-user")
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):
      argv += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      argv += ["--ro-bind", top, top]
  for path in _ETC:
    argv += ["--ro-bind-try", path, path]
  argv += ["--proc", "/proc", "--dev", "/dev"]
  for path in ("/tmp", "/dev/shm", "/scratch"):
    argv += ["--perms", "1777", "--size", size, "--tmpfs", path]
  made = set()  # After the tmpfs mounts: a venv under /tmp stays visible.
  for src, dst in sorted(prefixes, key=lambda p: p[1]):
    parts = dst.strip("/").split("/")
    for i in range(1, len(parts)):  # Parents as 0755 dirs (bwrap: 0700).
      parent = "/" + "/".join(parts[:i])
      if parent not in made:
        made.add(parent)
        argv += ["--perms", "0755", "--dir", parent]
    argv += ["--ro-bind", src, dst]
  argv += ["--chdir", "/scratch", "--cap-drop", "ALL"]
  if root:
    argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  argv += ["--", exe, "-I"]
  return argv


def _mount_tmpfs(path: str, size_mb: int, uid: int) -> bool:
  """A size-limited tmpfs on `path` (root only); False where not allowed."""
  libc = ctypes.CDLL(None, use_errno=True)
  opts = f"size={size_mb << 20},mode=0700,uid={uid},gid={uid}".encode()
  return libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, opts) == 0


def _unmount(path: str) -> None:
  ctypes.CDLL(None, use_errno=True).umount2(path.encode(), 2)  # MNT_DETACH


class Launched:
  """A started server: its process, uid, host scratch (fallback), cgroup,
  and the file its stderr goes to (read when it fails to start)."""

  def __init__(self, proc: subprocess.Popen, uid: int | None,
               scratch: str | None, cgroup: cgroup_lib.Cgroup,
               stderr: Any, scratch_mounted: bool = False):
    self.proc = proc
    self.uid = uid
    self.scratch = scratch
    self.cgroup = cgroup
    self.stderr = stderr
    self.scratch_mounted = scratch_mounted

  def stderr_tail(self, chars: int = 2000) -> str:
    self.stderr.seek(0)
    return self.stderr.read().decode(errors="replace")[-chars:]

  def release(self) -> None:
    """The host-side resources (after the processes are gone)."""
    self.stderr.close()
    self.cgroup.close()
    if self.scratch:
      if self.scratch_mounted:
        _unmount(self.scratch)
      shutil.rmtree(self.scratch, ignore_errors=True)


def launch(mechanism: str, limits: Limits, preload: Sequence[str],
           slot: int, cgroup: cgroup_lib.Cgroup,
           namespaces: bool = True, packages: bool = True) -> Launched:
  """Starts `inside.py` under `mechanism` ('bwrap' or 'landlock').

  `namespaces=False`: no user, pid and IPC namespaces per call even where
  the kernel allows them (the path of machines without user namespaces).
  `packages=False`: the standard library only (`interpreter`).
  """
  ensure_subreaper()
  root = os.getuid() == 0
  uid = sandbox_uid(slot) if root else None
  exe, prefixes = interpreter(mechanism, packages)
  env = dict(_ENV)
  venv = packages and exe == sys.executable
  unix = mechanism == "bwrap"
  cfg = {"uid": uid, "limits": limits.as_dict(),
         "preload": list(preload) if venv else [],
         "sys_path": site.getsitepackages() if venv else [],
         "try_namespaces": namespaces,
         "seccomp_ns": seccomp_policy.bpf_program(unix_sockets=unix),
         "seccomp_no_ipc": seccomp_policy.bpf_program(unix_sockets=unix,
                                                      ipc=False)}
  scratch, mounted = None, False
  stderr = tempfile.TemporaryFile()  # pylint: disable=consider-using-with
  try:
    if mechanism == "bwrap":
      argv = _bwrap_argv(limits, exe, prefixes)
      env.update(HOME="/scratch", TMPDIR="/tmp")
      cfg.update(scratch="/scratch", wipe=["/scratch", "/tmp", "/dev/shm"],
                 landlock=None)
    elif mechanism == "landlock":
      scratch = tempfile.mkdtemp(prefix="sao_sandbox_")
      mounted = root and _mount_tmpfs(scratch, limits.scratch_mb, uid)
      for sub in ("tmp", "shm"):
        os.mkdir(os.path.join(scratch, sub))
        if uid is not None:
          os.chown(os.path.join(scratch, sub), uid, uid)
      if uid is not None:
        os.chown(scratch, uid, uid)
      env.update(HOME=scratch, TMPDIR=os.path.join(scratch, "tmp"))
      ro = ["/usr", "/bin", "/sbin", "/lib", "/lib64", *_ETC,
            *(src for src, _ in prefixes),
            os.path.dirname(os.path.realpath(exe))]
      cfg.update(scratch=scratch, wipe=[os.path.join(scratch, "tmp"),
                                        os.path.join(scratch, "shm"), scratch],
                 landlock={"ro": ro, "rw": [scratch, "/dev/null"]})
      argv = [exe, "-I"]
    else:
      raise ValueError(f"launch: mechanism {mechanism!r} is not a sandbox.")
    cfg["env"] = env
    # -S: no site (its .pth files cost start-up time); inside.py appends the
    # site-packages directories itself.
    argv += ["-S", "-c", _BOOT, *_inside_source(), marshal.dumps(cfg).hex()]
    if cgroup.procs_files:
      # A shell joins the cgroups, then execs the launch: all the sandbox's
      # processes inherit them. Not a preexec_fn, with which Popen forks this
      # whole process (the sampler's: GBs of page tables, ~7 ms a launch at
      # 3 GB resident) instead of the ~1 ms vfork it uses otherwise.
      argv = ["/bin/sh", "-c", _JOIN_THEN_EXEC, "sh", *cgroup.procs_files,
              "--", *argv]
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
        env=env, cwd=scratch or "/", start_new_session=True, bufsize=0)
  except BaseException:
    Launched(None, uid, scratch, cgroup_lib.Cgroup([], "none"), stderr,
             mounted).release()
    raise
  return Launched(proc, uid, scratch, cgroup, stderr, mounted)
