"""What the sandbox's processes do to themselves and to their scratch
(docs/design/sandbox.md "A clean slate per call"): the server's own
confinement, the call's limits, Landlock, the seccomp filter, capabilities,
and the wipe between calls.

Stdlib only: in the sandbox this file is not imported from the repository
but handed to the interpreter by launcher.py, as module
`sao_sandbox_confine`, beside inside.py.
"""

import ctypes
import os
import resource
import struct

LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 4, 38, 36
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_NR_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
# Landlock access rights (linux/landlock.h).
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ALL_V1 = (1 << 13) - 1
_FS_ABI_EXTRA = {2: 1 << 13, 3: 1 << 14, 5: 1 << 15}  # REFER, TRUNCATE, IOCTL.
_FS_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_NET_BIND_CONNECT_TCP = 3
_SCOPE_UNIX_AND_SIGNAL = 3


def prctl(option, arg):
  if LIBC.prctl(option, arg, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), f"prctl({option})")


def confine_server(uid, landlock_paths):
  """The pristine parent's own confinement: the unprivileged `uid` (when
  started as root), no new privileges, not dumpable, child subreaper, no
  core files, and Landlock to `landlock_paths` ({"ro": ..., "rw": ...}; the
  fallback) when given."""
  if uid is not None and os.getuid() == 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  prctl(_PR_SET_NO_NEW_PRIVS, 1)
  prctl(_PR_SET_DUMPABLE, 0)
  prctl(_PR_SET_CHILD_SUBREAPER, 1)
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  if landlock_paths:
    landlock(landlock_paths["ro"], landlock_paths["rw"])


def limit_call(limits, seccomp, per_call_ns):
  """The call's process: capabilities dropped (it holds all of its own user
  namespace's when `per_call_ns`), the `seccomp` filter, the rlimits of
  `limits` (a `Limits.as_dict()`)."""
  if per_call_ns:
    drop_capabilities()
  load_seccomp(seccomp)
  mib = 1 << 20
  for res, value in ((resource.RLIMIT_AS, limits["memory_mb"] * mib),
                     (resource.RLIMIT_NPROC, limits["processes"]),
                     (resource.RLIMIT_NOFILE, limits["open_files"]),
                     (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mib),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (value, value))
  cpu = int(limits["cpu_s"])
  resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))


def landlock(ro_paths, rw_paths):
  """Restricts this process (and its children) to the given hierarchies."""
  create, add_rule, restrict = _NR_LANDLOCK[os.uname().machine]
  syscall = LIBC.syscall
  abi = syscall(create, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
  if abi < 1:
    raise OSError(ctypes.get_errno(), "Landlock is not available")
  fs = _FS_ALL_V1
  for version, bit in _FS_ABI_EXTRA.items():
    if abi >= version:
      fs |= bit
  net = _NET_BIND_CONNECT_TCP if abi >= 4 else 0
  scoped = _SCOPE_UNIX_AND_SIGNAL if abi >= 6 else 0
  attr = struct.pack("QQQ", fs, net, scoped)[:8 if abi < 4 else
                                               16 if abi < 6 else 24]
  buf = ctypes.create_string_buffer(attr, len(attr))
  ruleset = syscall(create, buf, len(attr), 0)
  if ruleset < 0:
    raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
  for paths, access in ((ro_paths, _FS_READ), (rw_paths, fs)):
    for path in paths:
      try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
      except FileNotFoundError:
        continue
      allowed = access
      if not os.path.isdir(path):  # File rules take file rights only.
        allowed &= _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | (
            1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
      rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
      rc = syscall(add_rule, ruleset, 1, rule, 0)  # LANDLOCK_RULE_PATH_BENEATH
      os.close(fd)
      if rc != 0:
        raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
  if syscall(restrict, ruleset, 0) != 0:
    raise OSError(ctypes.get_errno(), "landlock_restrict_self")
  os.close(ruleset)


def load_seccomp(program):
  """Loads a compiled BPF program (a struct sock_filter array)."""
  filt = ctypes.create_string_buffer(program, len(program))

  class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

  fprog = _Fprog(len(program) // 8, ctypes.cast(filt, ctypes.c_void_p))
  if LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                 ctypes.byref(fprog), 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "seccomp filter")


def drop_capabilities():
  """No capabilities left (D holds all of its user namespace's)."""
  for cap in range(64):
    if LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
      break  # Past the last capability this kernel knows.
  LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
  header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
  if LIBC.capset(header, bytes(24)) != 0:
    raise OSError(ctypes.get_errno(), "capset")


def wipe(dirs):
  """Empties `dirs` (their own mode restored), whatever a call did to the
  permissions of what it made; mount points in them (the interpreter's
  prefixes bound under /tmp) and the directories that lead to them stay.
  True when nothing else is left."""
  clean = True
  keep = {d for d, _ in dirs}  # The fallback's tmp/ and shm/ in scratch.
  for d, mode in dirs:
    try:
      st = os.lstat(d)
      if st.st_mode & 0o7777 != mode:
        os.chmod(d, mode)
      clean &= _empty(d, st.st_dev, keep)[0]
    except OSError:
      clean = False
  return clean


def _empty(d, dev, keep):
  """Removes what is in `d` on device `dev`; returns (True when that is all
  of it, True when `d` leads to a mount point and so must stay)."""
  try:
    entries = os.listdir(d)
  except PermissionError:
    os.chmod(d, 0o700)  # The owner may always; then list again.
    entries = os.listdir(d)
  clean, mounts = True, False
  for name in entries:
    path = os.path.join(d, name)
    st = os.lstat(path)
    if st.st_dev != dev:
      mounts = True  # A mount point (a read-only bind): it stays.
      continue
    if path in keep:
      continue  # Wiped on its own.
    if (st.st_mode & 0o170000) == 0o040000:
      if st.st_mode & 0o700 != 0o700:
        os.chmod(path, 0o700)
      sub_clean, sub_mounts = _empty(path, dev, keep)
      if not sub_clean:
        clean = False
      elif sub_mounts:
        mounts = True  # E.g. /tmp/<checkout> above a venv bound there.
      else:
        try:
          os.rmdir(path)
        except OSError:
          clean = False
    else:
      os.unlink(path)
  return clean, mounts
