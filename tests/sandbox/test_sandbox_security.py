"""Security tests of sao_jax.sandbox (issue 28 item 4; docs/design/sandbox.md
"Code sandbox").

Every attack runs against each sandbox (bwrap warm, bwrap strict, Landlock
warm) and against `PlainRunner`, a plain `python -c` subprocess with a
time-out: `contained` must be True for the sandboxes and False for the plain
runner, so each test is shown to fail without a sandbox. Payloads that leave
processes are bounded (a fork tree of 127, not an unbounded bomb), and their
leftovers under the plain runner are killed by the pids they wrote, so the
shared machine never runs an unbounded payload. Leftover checks count only the
processes of this test's own sandboxes (their uids) or its own pid files.
"""

import dataclasses
import os
import secrets
import signal
import socket
import sys
import time

import pytest
import sandbox_pools

from sao_jax.sandbox import cgroup
from sao_jax.sandbox import launcher
from sao_jax.sandbox.limits import Limits
from sao_jax.sandbox.pool import PlainRunner
from sao_jax.sandbox.pool import SandboxPool

pytestmark = pytest.mark.multiprocess

# wall_s leaves a loaded machine (CI shares one; pytest-xdist runs another
# worker beside this file) time to start each call's interpreter.
LIMITS = Limits(wall_s=5.0, cpu_s=2, memory_mb=512, total_memory_mb=768,
                processes=16, open_files=32, file_size_mb=4, scratch_mb=16,
                output_bytes=65536)
RUNNERS = ("bwrap_warm", "bwrap_strict", "landlock_warm", "plain")
TOKEN = "sao-secret-" + secrets.token_hex(8)
_POOLS = sandbox_pools.Cache(LIMITS)


def _make(kind):
  return sandbox_pools.make(kind, LIMITS)


@pytest.fixture(params=RUNNERS)
def runner(request):
  yield _POOLS.get(request.param)


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
  yield
  _POOLS.close()


def _expect(runner, contained):
  assert contained == (runner.mechanism != "unsafe_subprocess"), (
      runner.mechanism, contained)


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _leftovers(runner, pid_dir):
  """Processes the call left: the pool's sandbox uids, or (plain) the pids
  the payload wrote into `pid_dir` (killed here after counting)."""
  if runner.mechanism != "unsafe_subprocess":
    left = runner.leftovers()
    if left is None:
      pytest.skip("leftover processes are counted by sandbox uid (root)")
    return left
  pids = [int(n) for n in os.listdir(pid_dir)]
  left = [p for p in pids if _alive(p)]
  for p in pids:
    try:
      os.kill(p, signal.SIGKILL)
    except ProcessLookupError:
      pass
  return left


# Payload fragment: fork a child that closes its stdio, records its pid in
# PID_DIR (if it can) and runs BODY.
_SPAWN = """
import os, time
def spawn(body, setsid=False):
  pid = os.fork()
  if pid == 0:
    if setsid:
      os.setsid()
    try:
      open(os.path.join({pid_dir!r}, str(os.getpid())), "w").close()
    except OSError:
      pass
    os.closerange(0, 3)
    body()
    os._exit(0)
  return pid
"""


def test_host_environ_memory_and_cmdline(runner):
  secret = (TOKEN + "-mem").encode()
  os.environ["SAO_SANDBOX_TEST_SECRET"] = TOKEN
  address = id(secret) + 32  # PyBytesObject's data (CPython, 64-bit).
  code = f"""
import os
found = []
if {TOKEN!r} in str(os.environ):
  found.append("environ")
for name in ("environ", "cmdline"):
  try:
    data = open("/proc/{os.getpid()}/" + name, "rb").read()
    if {TOKEN!r}.encode() in data or data == {open('/proc/self/cmdline', 'rb').read()!r}:
      found.append(name)
  except OSError:
    pass
try:
  with open("/proc/{os.getpid()}/mem", "rb") as f:
    f.seek({address})
    if f.read({len(secret)}) == {secret!r}:
      found.append("mem")
except (OSError, ValueError, OverflowError):
  pass
print(",".join(found))
"""
  r = runner.run(code)
  del os.environ["SAO_SANDBOX_TEST_SECRET"]
  assert r.exit_code == 0, r
  _expect(runner, r.stdout.strip() == "")
  if runner.mechanism == "unsafe_subprocess":
    assert {"environ", "cmdline", "mem"} <= set(r.stdout.strip().split(","))


def test_private_file_shm_segment_and_shadow(runner, tmp_path):
  private = tmp_path / "key"
  private.write_text(TOKEN)
  private.chmod(0o600)
  shm = f"/dev/shm/sao_sandbox_test_{os.getpid()}_{secrets.token_hex(4)}"
  fd = os.open(shm, os.O_CREAT | os.O_WRONLY, 0o600)
  os.write(fd, TOKEN.encode())
  os.close(fd)
  try:
    r = runner.run(f"""
got = []
for path in ({str(private)!r}, {shm!r}, "/etc/shadow"):
  try:
    got.append(len(open(path).read()) > 0)
  except OSError:
    got.append(False)
print(sum(got))
""")
  finally:
    os.unlink(shm)
  assert r.exit_code == 0, r
  _expect(runner, r.stdout.strip() == "0")


def test_loopback_tcp_and_unix_sockets(runner, tmp_path):
  tcp = socket.socket()
  tcp.bind(("127.0.0.1", 0))
  tcp.listen(4)
  path = str(tmp_path / "host.sock")
  unix = socket.socket(socket.AF_UNIX)
  unix.bind(path)
  unix.listen(4)
  abstract = socket.socket(socket.AF_UNIX)
  abstract_name = f"\0sao_sandbox_test_{os.getpid()}_{secrets.token_hex(4)}"
  abstract.bind(abstract_name)
  abstract.listen(4)
  r = runner.run(f"""
import socket
ok = 0
for family, address in ((socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]})),
                        (socket.AF_UNIX, {path!r}), (socket.AF_UNIX, {abstract_name!r})):
  try:
    s = socket.socket(family)
    s.settimeout(1)
    s.connect(address)
    s.sendall(b"hello")
    ok += 1
  except OSError:
    pass
print(ok)
""")
  received = []  # Connections made during the call wait in the backlog.
  for s in (tcp, unix, abstract):
    s.settimeout(0.05)
    try:
      conn, _ = s.accept()
      received.append(conn.recv(64))
      conn.close()
    except OSError:
      pass
    s.close()
  assert r.exit_code == 0, r
  _expect(runner, r.stdout.strip() == "0" and not received)


def test_writes_stay_inside(runner, tmp_path):
  name = f"sao_sandbox_escape_{os.getpid()}_{secrets.token_hex(4)}"
  targets = [str(tmp_path / name), f"/tmp/{name}", f"/dev/shm/{name}"]
  r = runner.run(f"""
import os
for path in {targets!r} + ["scratch_" + {name!r}]:
  try:
    with open(path, "w") as f:
      f.write("x")
  except OSError as e:
    print("denied", path)
print("scratch", os.path.exists("scratch_" + {name!r}))
""")
  escaped = [t for t in targets if os.path.exists(t)]
  for t in escaped + [os.path.join(os.getcwd(), "scratch_" + name)]:
    if os.path.exists(t):
      os.unlink(t)
  assert r.exit_code == 0 and "scratch True" in r.stdout, r
  _expect(runner, not escaped)


def test_no_user_namespace(runner):
  r = runner.run("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000))  # CLONE_NEWUSER
""")
  assert r.exit_code == 0, r
  _expect(runner, r.stdout.strip() == "-1")


def test_only_stdio_fds(runner):
  if runner.mechanism == "unsafe_subprocess":
    runner = PlainRunner(LIMITS, close_fds=False)  # A runner that forks.
  leak = os.open("/dev/null", os.O_RDONLY)
  os.set_inheritable(leak, True)
  try:
    r = runner.run("""
import os
open_fds = []
for fd in range(256):
  try:
    os.fstat(fd)
    open_fds.append(fd)
  except OSError:
    pass
print(open_fds)
""")
  finally:
    os.close(leak)
  assert r.exit_code == 0, r
  _expect(runner, r.stdout.strip() == "[0, 1, 2]")


def test_setsid_orphan_is_gone(runner, tmp_path):
  r = runner.run(_SPAWN.format(pid_dir=str(tmp_path)) + """
spawn(lambda: time.sleep(60), setsid=True)
print("spawned")
""")
  assert r.stdout.strip() == "spawned", r
  left = _leftovers(runner, tmp_path)
  _expect(runner, left == [])


def test_fork_bomb_then_50_calls(runner, tmp_path):
  r = runner.run(_SPAWN.format(pid_dir=str(tmp_path)) + """
def tree(depth):  # A bounded bomb: 2**7 - 1 processes if nothing stops it.
  for _ in range(2):
    try:
      spawn(lambda: tree(depth - 1) if depth > 1 else time.sleep(60))
    except OSError:
      pass
  time.sleep(60)
tree(7)
""")
  left = _leftovers(runner, tmp_path)
  results = [runner.run(f"print({i} * 2)") for i in range(50)]
  assert [x.stdout for x in results] == [f"{i * 2}\n" for i in range(50)]
  _expect(runner, r.timed_out and left == [])


@pytest.mark.parametrize("body", ["while True: pass", "time.sleep(100)"])
def test_loop_and_sleep_end_within_limit(runner, tmp_path, body):
  t0 = time.monotonic()
  r = runner.run(_SPAWN.format(pid_dir=str(tmp_path)) + f"""
def work():
  {body}
spawn(work)
work()
""")
  elapsed = time.monotonic() - t0
  left = _leftovers(runner, tmp_path)
  assert r.timed_out, r
  # Ended within the limit + 1 s as the server timed the call; the host's
  # figure adds the launch and clean-up, slower on a loaded machine.
  _expect(runner, r.exec_s < LIMITS.wall_s + 1
          and elapsed < LIMITS.wall_s + 10 and left == [])


def test_10_gib_allocation_fails(runner):
  r = runner.run("b = bytearray(10 << 30)\nprint('allocated')")
  _expect(runner, "allocated" not in r.stdout and r.memory_error)


@pytest.mark.parametrize("kind", ["bwrap_warm", "landlock_warm", "plain"])
def test_total_memory_is_bounded(kind):
  """RLIMIT_AS alone lets every process have its 512 MiB; the cgroup
  (768 MiB for the sandbox) kills some of four that each touch 256 MiB.

  The four hold their memory at once: each fills its 256 MiB, says so on
  `ready` and waits on `release`, which the parent closes only when every
  child has filled or died (`ready` reaches end-of-file). Without that
  barrier a loaded machine can run the children one after another, and
  their sum never passes the cgroup's bound (seen once in CI).
  """
  probe_cg = cgroup.Cgroup.create(LIMITS.total_memory_mb, LIMITS.processes)
  probe_cg.close()
  if probe_cg.kind == "none" and kind != "plain":
    pytest.skip("no memory cgroup can be made here")
  limits = dataclasses.replace(LIMITS, wall_s=20.0, cpu_s=20)  # Reclaim.
  if kind == "plain":
    runner = PlainRunner(limits)
  else:
    _make(kind).close()  # Skips where the mechanism is missing.
    runner = SandboxPool(limits, mechanism=kind.split("_")[0])
  try:
    r = runner.run("""
import os
ready_r, ready_w = os.pipe()
release_r, release_w = os.pipe()
kids = []
for _ in range(4):
  pid = os.fork()
  if pid == 0:
    os.close(ready_r); os.close(release_w)
    b = b"x" * (256 << 20)  # Filled: every page touched.
    os.write(ready_w, b"1"); os.close(ready_w)
    os.read(release_r, 1)  # Holds b until the parent lets go.
    os._exit(0)
  kids.append(pid)
os.close(ready_w); os.close(release_r)
while os.read(ready_r, 4):
  pass  # End-of-file: every child has filled its memory or died.
os.close(release_w)
print(sum(os.waitpid(k, 0)[1] != 0 for k in kids))
""")
  finally:
    runner.close()
  assert not r.timed_out, r
  _expect(runner, int(r.stdout) > 0 and r.memory_error)


def _peak_rss_mb():
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  raise AssertionError("no VmHWM in /proc/self/status")


def test_printing_1_gib_is_cut(runner):
  before = _peak_rss_mb()
  t0 = time.monotonic()
  r = runner.run("""
import sys
chunk = "x" * (1 << 20)
for _ in range(1024):
  sys.stdout.write(chunk)
""")
  elapsed = time.monotonic() - t0
  growth = _peak_rss_mb() - before
  assert len(r.stdout) <= LIMITS.output_bytes
  _expect(runner, r.truncated and elapsed < 1.0 and growth < 10)


@pytest.mark.parametrize("kind", ["bwrap_strict"])
def test_200_fresh_sandboxes_start(kind):
  pool = _make(kind)
  try:
    outs = [pool.run(f"print({i})").stdout for i in range(200)]
  finally:
    pool.close()
  assert outs == [f"{i}\n" for i in range(200)]
  # Without the subreaper's reaping each launch would leave a zombie bwrap
  # (the trap that ends in `bwrap: Can't fork`): none is left.
  zombies = [p for p in _own_children() if launcher._is_sandbox_zombie(p)]  # pylint: disable=protected-access
  assert zombies == []


def _own_children():
  out = []
  for task in os.listdir(f"/proc/{os.getpid()}/task"):
    with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
      out += [int(p) for p in f.read().split()]
  return out


def test_zombie_check_fails_without_reaping(monkeypatch):
  """The check above can fail: with reaping off, 5 launches leave 5."""
  pool = _make("bwrap_strict")
  monkeypatch.setattr(launcher, "reap_orphans", lambda **_: 0)
  try:
    for i in range(5):
      pool.run(f"print({i})")
    end = time.monotonic() + 5  # The last one dies after its parent.
    while True:
      zombies = [p for p in _own_children()
                 if launcher._is_sandbox_zombie(p)]  # pylint: disable=protected-access
      if len(zombies) >= 5 or time.monotonic() > end:
        break
      time.sleep(0.01)
  finally:
    pool.close()
    monkeypatch.undo()
    launcher.reap_orphans()
  assert len(zombies) == 5
  assert not [p for p in _own_children()
              if launcher._is_sandbox_zombie(p)]  # pylint: disable=protected-access


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))
