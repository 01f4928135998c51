"""The interpreter inside a sandbox: confines itself, then runs calls.

Run as `python -I -S -c <this file's source> <config>` (stdlib only: it is
not imported from the repository, whose files the sandbox cannot see; the
config is a hex `marshal` dict). It reads requests on fd 0 (`marshal` dicts,
from the trusted host) and answers on fd 1 in JSON (which the host parses
safely whatever a compromised server sends), each message after a 4-byte
big-endian length (docs/design/sandbox.md "Code sandbox"):

  ready  -> {"ready": true, "preloaded": [...], "isolation": {...}}
            (or {"error": ...})
  {"code": SRC} -> CallResult fields

It imports little (no json, re or shutil: start-up time is a strict call's
latency).

Processes (docs/design/sandbox.md "A clean slate per call"): the *pristine
parent* P confines itself (drop to the unprivileged uid when started as root, no
new privileges, not dumpable, child subreaper, Landlock in the fallback, the
preloads) and then never reads a request or runs user code. For each call it
forks S, which enters new user, pid and IPC namespaces and forks the call server
C (pid 1 there): C reads the request, forks the child D that runs it (rlimits,
capabilities dropped, the seccomp filter, fds 0-2 only, fresh globals), answers,
and kills everything else in its pid namespace. When C exits the namespaces die
with every process and IPC object of the call; P reaps, checks that its own
limits and priority are what they were, and empties scratch, /tmp and /dev/shm
(restoring permissions a call took away) before the next call. Without user
namespaces P serves calls itself (`isolation` says what is then not held) and
the seccomp filter denies System V and POSIX IPC.
"""

import _json
import ctypes
import marshal
import os
import resource
import select
import signal
import struct
import sys
import time

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 4, 38, 36
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_NR_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
# Landlock access rights (linux/landlock.h).
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ALL_V1 = (1 << 13) - 1
_FS_ABI_EXTRA = {2: 1 << 13, 3: 1 << 14, 5: 1 << 15}  # REFER, TRUNCATE, IOCTL.
_FS_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_NET_BIND_CONNECT_TCP = 3
_SCOPE_UNIX_AND_SIGNAL = 3
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWIPC = 0x10000000, 0x20000000, 0x08000000
_RLIMITS = tuple(getattr(resource, n) for n in dir(resource)
                 if n.startswith("RLIMIT_"))


def _prctl(option, arg):
  if _LIBC.prctl(option, arg, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), f"prctl({option})")


def _landlock(ro_paths, rw_paths):
  """Restricts this process (and its children) to the given hierarchies."""
  create, add_rule, restrict = _NR_LANDLOCK[os.uname().machine]
  syscall = _LIBC.syscall
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


def _load_seccomp(program):
  """Loads a compiled BPF program (a struct sock_filter array)."""
  filt = ctypes.create_string_buffer(program, len(program))

  class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

  fprog = _Fprog(len(program) // 8, ctypes.cast(filt, ctypes.c_void_p))
  if _LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                 ctypes.byref(fprog), 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "seccomp filter")


def _drop_capabilities():
  """No capabilities left (D holds all of its user namespace's)."""
  for cap in range(64):
    if _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
      break  # Past the last capability this kernel knows.
  _LIBC.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
  header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
  if _LIBC.capset(header, bytes(24)) != 0:
    raise OSError(ctypes.get_errno(), "capset")


def _encode(obj):
  """JSON of dicts, lists, str, bool, int, float and None."""
  if isinstance(obj, str):
    return _json.encode_basestring_ascii(obj)
  if isinstance(obj, bool):
    return "true" if obj else "false"
  if obj is None:
    return "null"
  if isinstance(obj, (int, float)):
    return repr(obj)
  if isinstance(obj, dict):
    return "{" + ",".join(f"{_encode(str(k))}:{_encode(v)}"
                          for k, v in obj.items()) + "}"
  return "[" + ",".join(_encode(v) for v in obj) + "]"


def _send(obj, fd=1):
  data = _encode(obj).encode()
  data = struct.pack(">I", len(data)) + data
  while data:
    data = data[os.write(fd, data):]


def _recv():
  head = _read_exact(4)
  return None if head is None else marshal.loads(_read_exact(
      struct.unpack(">I", head)[0]))


def _read_exact(n):
  buf = b""
  while len(buf) < n:
    chunk = os.read(0, n - len(buf))
    if not chunk:
      return None
    buf += chunk
  return buf


def _child(code, cfg, out_w, err_w):
  """Runs one call (in the forked child); never returns."""
  lim = cfg["limits"]
  status = 1
  try:
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 1 << 20)
    os.chdir(cfg["scratch"])
    if cfg["per_call_ns"]:
      _drop_capabilities()
    _load_seccomp(cfg["seccomp"])
    os.environ.clear()
    os.environ.update(cfg["env"])
    mib = 1 << 20
    for res, value in ((resource.RLIMIT_AS, lim["memory_mb"] * mib),
                       (resource.RLIMIT_NPROC, lim["processes"]),
                       (resource.RLIMIT_NOFILE, lim["open_files"]),
                       (resource.RLIMIT_FSIZE, lim["file_size_mb"] * mib),
                       (resource.RLIMIT_CORE, 0)):
      resource.setrlimit(res, (value, value))
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
      signal.signal(sig, signal.SIG_DFL)
    sys.stdin = open(0, "r", closefd=False)  # pylint: disable=consider-using-with
    sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")  # pylint: disable=consider-using-with
    sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # pylint: disable=consider-using-with
    sys.argv = ["<tool>"]
    glb = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
      exec(compile(code, "<tool>", "exec"), glb)  # pylint: disable=exec-used
      status = 0
    except SystemExit as e:
      status = e.code if isinstance(e.code, int) else (0 if e.code is None
                                                       else 1)
    except MemoryError:
      sys.stderr.write("MemoryError\n")
    except BaseException as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      # The call's frames only (not this server's).
      traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except BaseException:  # pylint: disable=broad-except
        pass
  finally:
    os._exit(status & 0xFF)  # pylint: disable=protected-access


def _kill_all_others(deadline_s=2.0):
  """SIGKILLs and reaps the call's leftovers; True when none is left.

  Every process a call starts descends from this server, a child subreaper,
  so its orphans are re-parented here: when waitpid finds no child, none is
  left. kill(-1) reaches them all (the pid namespace, or the sandbox's own
  uid, holds nothing else the server may signal), setsid ones included.
  """
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    try:
      os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
      pass
    try:
      while os.waitpid(-1, os.WNOHANG)[0]:
        pass
    except ChildProcessError:
      return True
    time.sleep(0.0005)
  return False


def _wipe(dirs):
  """Empties `dirs` (their own mode restored), whatever a call did to the
  permissions of what it made; mount points in them (the interpreter's
  prefixes bound under /tmp) stay. True when nothing is left."""
  clean = True
  keep = {d for d, _ in dirs}  # The fallback's tmp/ and shm/ in scratch.
  for d, mode in dirs:
    try:
      st = os.lstat(d)
      if st.st_mode & 0o7777 != mode:
        os.chmod(d, mode)
      clean &= _empty(d, st.st_dev, keep)
    except OSError:
      clean = False
  return clean


def _empty(d, dev, keep):
  """Removes what is in `d` on device `dev`; True when that is all of it."""
  try:
    entries = os.listdir(d)
  except PermissionError:
    os.chmod(d, 0o700)  # The owner may always; then list again.
    entries = os.listdir(d)
  clean = True
  for name in entries:
    path = os.path.join(d, name)
    st = os.lstat(path)
    if st.st_dev != dev or path in keep:
      continue  # A mount point (read-only bind), or wiped on its own.
    if (st.st_mode & 0o170000) == 0o040000:
      if st.st_mode & 0o700 != 0o700:
        os.chmod(path, 0o700)
      if _empty(path, dev, keep):
        try:
          os.rmdir(path)
        except OSError:
          clean = False
      else:
        clean = False
    else:
      os.unlink(path)
  return clean


def _call(code, cfg):
  """Forks, runs `code`, collects its output within the limits."""
  lim = cfg["limits"]
  cap = int(lim["output_bytes"])
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  t0 = time.monotonic()
  pid = os.fork()
  if pid == 0:
    os.close(out_r)
    os.close(err_r)
    _child(code, cfg, out_w, err_w)
  os.close(out_w)
  os.close(err_w)
  pidfd = os.pidfd_open(pid)
  bufs = {out_r: bytearray(), err_r: bytearray()}
  open_fds = [out_r, err_r]
  deadline = t0 + float(lim["wall_s"])
  timed_out = truncated = killed = exited = False
  status = 0
  while True:
    now = time.monotonic()
    if not killed and not exited and (truncated or now >= deadline):
      timed_out = not truncated
      os.kill(pid, signal.SIGKILL)
      killed = True
    if exited and (killed or not open_fds or now >= deadline):
      break
    if exited:  # Drain what is buffered; a leftover holding a pipe is
      wait_s = 0.01  # killed below.
    else:
      wait_s = 1.0 if killed else deadline - now
    ready, _, _ = select.select(open_fds + ([] if exited else [pidfd]), [], [],
                                wait_s)
    if exited and not ready:
      break
    for fd in ready:
      if fd == pidfd:
        _, status = os.waitpid(pid, 0)
        exited = True
        continue
      chunk = os.read(fd, 1 << 16)
      if not chunk:
        open_fds.remove(fd)
        continue
      room = cap - len(bufs[fd])
      bufs[fd] += chunk[:max(room, 0)]
      truncated |= len(chunk) > room
  exec_s = time.monotonic() - t0
  os.close(pidfd)
  clean = _kill_all_others()
  for fd in (out_r, err_r):
    try:  # Output written before the leftovers died.
      while len(bufs[fd]) < cap and fd in open_fds:
        ready, _, _ = select.select([fd], [], [], 0)
        chunk = os.read(fd, 1 << 16) if ready else b""
        if not chunk:
          break
        bufs[fd] += chunk[:cap - len(bufs[fd])]
    except OSError:
      pass
    os.close(fd)
  sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
  exit_code = -sig if sig else os.WEXITSTATUS(status)
  if sig == signal.SIGXCPU:
    timed_out = True
  stderr = bufs[err_r].decode(errors="replace")
  memory_error = (sig == signal.SIGKILL and not killed) or (
      exit_code == 1 and stderr.rstrip().rsplit("\n", 1)[-1].startswith(
          "MemoryError"))
  return {"stdout": bufs[out_r].decode(errors="replace"), "stderr": stderr,
          "exit_code": exit_code, "timed_out": timed_out,
          "memory_error": memory_error, "truncated": truncated,
          "exec_s": exec_s,
          "sandbox_error": "" if clean else "leftover processes survived"}


def _confine(cfg):
  """P's own set-up (module docstring); returns the preloaded modules."""
  uid = cfg.get("uid")
  if uid is not None and os.getuid() == 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  _prctl(_PR_SET_NO_NEW_PRIVS, 1)
  _prctl(_PR_SET_DUMPABLE, 0)
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  if cfg.get("landlock"):
    _landlock(cfg["landlock"]["ro"], cfg["landlock"]["rw"])
  sys.path.extend(cfg.get("sys_path", ()))
  preloaded = []
  for name in cfg.get("preload", ()):
    try:
      __import__(name)
      preloaded.append(name)
    except ImportError:
      pass
  return preloaded


def _namespaces_work():
  """Whether a child can enter new user, pid and IPC namespaces here."""
  pid = os.fork()
  if pid == 0:
    os._exit(_LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWIPC)  # pylint: disable=protected-access
             != 0)
  return os.waitpid(pid, 0)[1] == 0


def _own_state():
  """P's limits and priority: a call that could change them spoils P."""
  return ([resource.getrlimit(r) for r in _RLIMITS],
          os.getpriority(os.PRIO_PROCESS, 0))


def _serve_one(cfg, answer_fd):
  """Reads one request, runs it and writes the answer to `answer_fd` (in C,
  or in P without namespaces); False at end of input."""
  request = _recv()
  if request is None:
    return False
  _send(_call(request["code"], cfg), answer_fd)
  return True


def _spawn_call_server(cfg, answer_fd):
  """Forks S, which enters the namespaces and forks C (pid 1 there); S
  exits at once, so C becomes P's child. Returns C's pid (P's view)."""
  pid_r, pid_w = os.pipe()
  s = os.fork()
  if s == 0:
    code = 1
    try:
      os.close(pid_r)
      if _LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWPID | _CLONE_NEWIPC) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
      c = os.fork()
      if c == 0:
        os.close(pid_w)
        code = 0 if _serve_one(cfg, answer_fd) else 3
        os._exit(code)  # pylint: disable=protected-access
      os.write(pid_w, struct.pack(">i", c))
      code = 0
    finally:
      os._exit(code)  # pylint: disable=protected-access
  os.close(pid_w)
  data = os.read(pid_r, 4)
  os.close(pid_r)
  os.waitpid(s, 0)
  return struct.unpack(">i", data)[0] if len(data) == 4 else None


def _error_reply(message):
  return {"stdout": "", "stderr": "", "exit_code": -1,
          "sandbox_error": message}


def _wait_all(deadline_s=2.0):
  """Reaps every child of P; True when none is left."""
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    try:
      if os.waitpid(-1, os.WNOHANG)[0] == 0:
        time.sleep(0.0005)
    except ChildProcessError:
      return True
  return False


def _run_one(cfg, answer_fd):
  """One call, in C (namespaces) or here; '' when answered, None at end
  of input, else why the sandbox failed."""
  if not cfg["per_call_ns"]:
    return "" if _serve_one(cfg, answer_fd) else None
  c = _spawn_call_server(cfg, answer_fd)
  if c is None:
    return "the call server did not start"
  status = os.waitstatus_to_exitcode(os.waitpid(c, 0)[1])
  if status == 3:
    return None
  return "" if status == 0 else f"the call server died ({status})"


def main():
  cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
  try:
    preloaded = _confine(cfg)
    cfg["per_call_ns"] = cfg["try_namespaces"] and _namespaces_work()
    cfg["seccomp"] = cfg["seccomp_ns" if cfg["per_call_ns"] else
                         "seccomp_no_ipc"]
    wipe = [(d, os.lstat(d).st_mode & 0o7777) for d in cfg["wipe"]]
    answer_fd = os.memfd_create("answer")  # Never read into P's memory.
  except BaseException:  # pylint: disable=broad-except
    import traceback  # pylint: disable=g-import-not-at-top
    _send({"error": traceback.format_exc()})
    return
  ns = cfg["per_call_ns"]
  _send({"ready": True, "preloaded": preloaded, "uid": os.getuid(),
         "isolation": {"per_call_namespaces": ns, "pristine_server": ns}})
  baseline = _own_state()
  spoiled = ""
  while True:
    select.select([0], [], [])
    if spoiled or _own_state() != baseline:
      _send(_error_reply(spoiled or "a call changed the sandbox server's "
                         "limits or priority; replaced"))
      return
    os.ftruncate(answer_fd, 0)
    os.lseek(answer_fd, 0, os.SEEK_SET)
    failure = _run_one(cfg, answer_fd)
    if failure is None:
      return  # End of input.
    if not _wait_all() or not _wipe(wipe):
      spoiled = "the previous call's processes or files could not be removed"
    if failure:
      _send(_error_reply(failure))
      return
    # The answer goes out after the clean-up, straight from the kernel.
    size = os.fstat(answer_fd).st_size
    offset = 0
    while offset < size:
      offset += os.sendfile(1, answer_fd, offset, size - offset)


if __name__ == "__main__":
  main()
