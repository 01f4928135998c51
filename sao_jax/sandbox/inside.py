"""The interpreter inside a sandbox: confines itself, then runs calls.

Run by launcher.py as `python -I -S -c <boot> <confine.py> <this file>
<config>` (stdlib only: it is not imported from the repository, whose files
the sandbox cannot see; the config is a hex `marshal` dict). It reads
requests on fd 0 (`marshal` dicts, from the trusted host) and answers on
fd 1 in JSON (which the host parses safely whatever a compromised server
sends), each message after a 4-byte big-endian length
(docs/design/sandbox.md "Code sandbox"):

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

try:  # In the sandbox: launcher.py made confine.py this module.
  import sao_sandbox_confine as confine  # pylint: disable=g-import-not-at-top
except ImportError:  # On the host (pool.py reads the names above).
  from sao_jax.sandbox import confine  # pylint: disable=g-import-not-at-top

_LIBC = confine.LIBC
# CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWIPC: the namespaces of each call.
_CALL_NAMESPACES = 0x10000000 | 0x20000000 | 0x08000000
_PR_SET_NAME, _PR_GET_NAME = 15, 16
SPAWN_NAME, CALL_NAME = b"sao-spawn", b"sao-call"  # pool.py knows them.
_RLIMITS = tuple(getattr(resource, n) for n in dir(resource)
                 if n.startswith("RLIMIT_"))


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
  status = 1
  try:
    _LIBC.prctl(_PR_SET_NAME, cfg["name"], 0, 0, 0)  # P's, not C's.
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.closerange(3, 1 << 20)
    os.chdir(cfg["scratch"])
    confine.limit_call(cfg["limits"], cfg["seccomp"], cfg["per_call_ns"])
    os.environ.clear()
    os.environ.update(cfg["env"])
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
  confine.confine_server(cfg.get("uid"), cfg.get("landlock"))
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
    os._exit(_LIBC.unshare(_CALL_NAMESPACES) != 0)  # pylint: disable=protected-access
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


def _call_server(cfg, answer_fd, go_r, done_w):
  """C: waits for P's go, serves one call, says done; never returns."""
  code = 1
  try:
    _LIBC.prctl(_PR_SET_NAME, CALL_NAME, 0, 0, 0)
    keep = sorted({answer_fd, go_r, done_w})
    for lo, hi in zip([2] + keep, keep + [1 << 20]):
      os.closerange(lo + 1, hi)  # Nothing of P's or of another call's.
    code = 3  # Told to stop (P is gone), or the end of input.
    if os.read(go_r, 1) == b"g" and _serve_one(cfg, answer_fd):
      os.write(done_w, b"d")
      code = 0
  finally:
    os._exit(code)  # pylint: disable=protected-access


def _spawn_call_server(cfg, answer_fd):
  """Forks S, which enters new user, pid and IPC namespaces and forks C (pid
  1 there), then exits, so that C becomes P's child. C waits for a go
  before it reads a request. Returns (C's pid, go fd, done fd) or None."""
  pid_r, pid_w = os.pipe()
  go_r, go_w = os.pipe()
  done_r, done_w = os.pipe()
  # S and C are known by name to the host's leftover count, S from its first
  # instruction on.
  _LIBC.prctl(_PR_SET_NAME, SPAWN_NAME, 0, 0, 0)
  s = os.fork()
  if s == 0:
    code = 1
    try:
      if _LIBC.unshare(_CALL_NAMESPACES) == 0:
        c = os.fork()
        if c == 0:
          _call_server(cfg, answer_fd, go_r, done_w)
        os.write(pid_w, struct.pack(">i", c))
        code = 0
    finally:
      os._exit(code)  # pylint: disable=protected-access
  _LIBC.prctl(_PR_SET_NAME, cfg["name"], 0, 0, 0)
  for fd in (pid_w, go_r, done_w):
    os.close(fd)
  data = os.read(pid_r, 4)
  os.close(pid_r)
  os.waitpid(s, 0)
  if len(data) != 4:
    os.close(go_w)
    os.close(done_r)
    return None
  return struct.unpack(">i", data)[0], go_w, done_r


def _error_reply(message):
  return {"stdout": "", "stderr": "", "exit_code": -1,
          "sandbox_error": message}


def _wait_all(deadline_s=2.0, keep=None):
  """Reaps every child of P but `keep` (the waiting call server); True
  when no other is left."""
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    try:
      pid = os.waitpid(-1, os.WNOHANG)[0]
    except ChildProcessError:
      return True
    if pid == 0:
      if keep is not None and _only_child_is(keep):
        return True
      time.sleep(0.0005)
  return False


def _only_child_is(pid):
  """Whether P's one live child is `pid` (P's children, from /proc when it
  can read it; under Landlock it cannot, and trusts the pid namespace)."""
  try:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
      return f.read().split() == [str(pid)]
  except OSError:
    return True


def _send_answer(answer_fd):
  """The answer C wrote, sent by the kernel (its bytes never enter P)."""
  size = os.fstat(answer_fd).st_size
  offset = 0
  while offset < size:
    offset += os.sendfile(1, answer_fd, offset, size - offset)


def _run_in_call_server(chain, standby, answer_fd):
  """Gives `chain`'s C the go; while it runs, `standby()` forks the next
  one; sends the answer as soon as C has written it. Returns (next chain,
  '' when answered, None at end of input, else why the sandbox failed)."""
  c, go_w, done_r = chain
  try:
    os.write(go_w, b"g")
  except OSError:
    pass  # C is gone: seen below.
  os.close(go_w)
  following = standby()
  done = os.read(done_r, 1)
  os.close(done_r)
  if done == b"d":
    _send_answer(answer_fd)
  status = os.waitstatus_to_exitcode(os.waitpid(c, 0)[1])
  if done == b"d":
    return following, ""
  if status == 3:
    return following, None
  return following, f"the call server died ({status})"


def main():
  cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
  try:
    preloaded = _confine(cfg)
    name = ctypes.create_string_buffer(16)
    _LIBC.prctl(_PR_GET_NAME, name, 0, 0, 0)
    cfg["name"] = name.value
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
  standby = lambda: _spawn_call_server(cfg, answer_fd)
  chain = standby() if ns else None
  spoiled = ""
  while True:
    if not spoiled and _own_state() != baseline:
      spoiled = "a call changed the sandbox server's limits or priority"
    if ns and chain is None:
      spoiled = spoiled or "the call server did not start"
    if spoiled:
      select.select([0], [], [])  # The next request gets the error.
      _send(_error_reply(spoiled + "; replaced"))
      return
    os.ftruncate(answer_fd, 0)
    os.lseek(answer_fd, 0, os.SEEK_SET)
    if ns:  # The answer goes out as soon as it is written; the next call
      # waits for the clean-up below.
      chain, failure = _run_in_call_server(chain, standby, answer_fd)
    else:
      select.select([0], [], [])
      failure = "" if _serve_one(cfg, answer_fd) else None
    if failure is None:
      return  # End of input.
    if failure:
      _send(_error_reply(failure))
      return
    waiting = chain[0] if chain else None  # The next call server.
    if not _wait_all(keep=waiting) or not confine.wipe(wipe):
      spoiled = "the previous call's processes or files could not be removed"
    if not ns:
      _send_answer(answer_fd)


if __name__ == "__main__":
  main()
