"""No call can spoil another (issue 38; docs/design/sandbox.md "A clean slate
per call"): hostile calls against warm sandboxes, then a probe call that must
see nothing of them, for each kind of state a call could leave (files whose
permissions it stripped, System V and POSIX IPC objects, its server's limits
and priority, memory, the server's heap) and for the Landlock fallback's
own gaps. Each runner is a warm pool with one worker: bwrap and Landlock,
each with per-call namespaces (the default) and without them (as on a
machine without user namespaces), where the sandbox's own `isolation`
report must say what is then not held and the tests check that it is true.
"""

import ctypes
import dataclasses
import hashlib
import json
import os
import random
import secrets
import subprocess
import sys
import textwrap

import pytest
import sandbox_pools

from sao_jax.sandbox import cgroup
from sao_jax.sandbox import launcher
from sao_jax.sandbox import probe
from sao_jax.sandbox.limits import Limits
from sao_jax.sandbox.pool import SandboxError
from sao_jax.sandbox.pool import SandboxPool

pytestmark = pytest.mark.multiprocess

LIMITS = Limits(wall_s=5.0, cpu_s=3, memory_mb=512, total_memory_mb=768,
                processes=16, open_files=32, file_size_mb=4, scratch_mb=16,
                output_bytes=65536)
RUNNERS = ("bwrap", "landlock", "bwrap_no_ns", "landlock_no_ns")
_POOLS = sandbox_pools.Cache(LIMITS)


def _make(kind, limits=LIMITS):
  return sandbox_pools.make(kind, limits)


@pytest.fixture(params=RUNNERS)
def pool(request):
  yield _POOLS.get(request.param)


@pytest.fixture(scope="module", autouse=True)
def _close_pools():
  yield
  _POOLS.close()


def _isolation(p):
  (worker,) = p.workers
  if not worker.started:
    worker.start()
  return worker.isolation


def _json(result):
  assert result.exit_code == 0 and not result.sandbox_error, result
  return json.loads(result.stdout.strip().splitlines()[-1])


# The probe: what a call can see of earlier calls. Directories it may write
# (scratch, temp, /dev/shm where it has one) and what is in them, IPC
# objects under the keys and names hostile calls use, its limits and
# priority, the processes of its uid it can signal, and whether its own
# memory holds a hostile call's secret (by hash: the probe never holds it).
PROBE = """
import ctypes, hashlib, json, os, resource, tempfile
libc = ctypes.CDLL(None, use_errno=True)
listing = {}
for d in (os.getcwd(), tempfile.gettempdir(), "/dev/shm"):
  try:
    listing[d] = sorted(os.listdir(d))
  except OSError:
    pass  # The fallback sees no /dev/shm.
writable = all(os.access(d, os.W_OK | os.X_OK) for d in listing)
ipc = []
for key in KEYS:
  ipc += [libc.shmget(key, 0, 0) >= 0, libc.msgget(key, 0) >= 0,
          libc.semget(key, 0, 0) >= 0]
try:
  rt = ctypes.CDLL("librt.so.1", use_errno=True)
  ipc += [rt.mq_open(name.encode(), os.O_RDONLY) >= 0 for name in MQ_NAMES]
except OSError:
  pass
procs = 0
for pid in range(1, 4 << 10):
  try:
    os.kill(pid, 0)
    procs += 1
  except OSError:
    pass
found = 0
try:
  with open("/proc/self/maps") as maps:
    spans = [line.split() for line in maps]
  for fields in spans:  # The heap and anonymous memory, read in place.
    if not fields[1].startswith("rw") or fields[5:] not in ([], ["[heap]"]):
      continue
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    data = ctypes.string_at(lo, hi - lo)
    at = data.find(b"SAOHEAP")
    while at >= 0:
      found += hashlib.sha256(data[at:at + 31]).hexdigest() in HASHES
      at = data.find(b"SAOHEAP", at + 1)
  heap = "read"
except OSError:
  heap = "unreadable"
print(json.dumps({"listing": listing, "writable": writable, "ipc": ipc,
                  "nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                  "nice": os.getpriority(os.PRIO_PROCESS, 0), "procs": procs,
                  "heap_secrets": found, "heap": heap}))
"""


def _probe(p, keys=(), mq_names=(), hashes=()):
  return _json(p.run(f"KEYS = {list(keys)!r}\nMQ_NAMES = {list(mq_names)!r}\n"
                     f"HASHES = {list(hashes)!r}\n" + PROBE))


# Hostile calls. Each is (name, make(rng) -> (code, keys, mq names, secret
# hashes)); `keys` and names are what the probe looks for afterwards.
def _strip_dirs(rng):
  name = f"plant{rng.randrange(1 << 30)}"
  modes = [rng.choice((0o000, 0o100, 0o300, 0o500)) for _ in range(2)]
  return textwrap.dedent(f"""
  import os, tempfile
  dirs = [os.getcwd(), tempfile.gettempdir(), "/dev/shm"]
  for d in list(dirs):
    top = os.path.join(d, {name!r})
    try:
      os.makedirs(top + "/sub")
    except OSError:
      dirs.remove(d)  # The fallback's /dev/shm.
      continue
    for path in (top + "/answer", top + "/sub/answer", d + "/{name}.txt"):
      open(path, "w").write("42")
    os.chmod(top + "/sub", {modes[0]})
    os.chmod(top, {modes[1]})
    os.symlink("/nonexistent", os.path.join(d, {name!r} + ".link"))
    os.mkfifo(os.path.join(d, {name!r} + ".fifo"))
  for d in dirs:
    try:
      os.chmod(d, 0o500)  # Its own scratch, if it owns it.
    except OSError:
      pass
  print("planted")
  """), (), (), ()


def _ipc_objects(rng):
  key = rng.randrange(1 << 20, 1 << 30)
  mq = f"/saoplant{key}"
  return textwrap.dedent(f"""
  import ctypes, os
  libc = ctypes.CDLL(None, use_errno=True)
  made = [libc.shmget({key}, 1 << 20, 0o1666) >= 0,
          libc.msgget({key}, 0o1666) >= 0,
          libc.semget({key}, 1, 0o1666) >= 0]
  try:
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    made.append(rt.mq_open({mq.encode()!r}, os.O_CREAT | os.O_RDWR, 0o666,
                           None) >= 0)
  except OSError:
    pass
  print(made)
  """), (key,), (mq,), ()


def _server_limits(rng):
  nofile, nice = rng.choice((8, 16)), rng.choice((5, 19))
  return textwrap.dedent(f"""
  import os, resource
  hits = 0
  for pid in range(1, 4 << 10):
    try:
      resource.prlimit(pid, resource.RLIMIT_NOFILE, ({nofile}, {nofile}))
      hits += 1
    except (OSError, ValueError):
      pass
    try:
      os.setpriority(os.PRIO_PROCESS, pid, {nice})
      hits += 1
    except OSError:
      pass
  for which in (os.PRIO_PGRP, os.PRIO_USER):
    try:
      os.setpriority(which, 0, {nice})
      hits += 1
    except OSError:
      pass
  print(hits)
  """), (), (), ()


def _heap_secret(rng):
  secret = "SAOHEAP" + "".join(rng.choice("0123456789abcdef")
                               for _ in range(24))
  digest = hashlib.sha256(secret.encode()).hexdigest()
  # 500 copies in the request itself (31 kB, under malloc's mmap threshold):
  # a non-pristine server's freed request buffer keeps some of them whatever
  # else reused part of its heap since (a single copy was once overwritten,
  # in a suite run on a loaded machine).
  return (f"answer = {secret!r}\n# {secret * 500}\nprint(answer * 1000)\n",
          (), (), (digest,))


def _leftover_process(rng):
  seconds = rng.choice((30, 60))
  return textwrap.dedent(f"""
  import os, time
  if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
      time.sleep({seconds})
    os._exit(0)
  print("forked")
  """), (), (), ()


ATTACKS = {"strip_dirs": _strip_dirs, "ipc_objects": _ipc_objects,
           "server_limits": _server_limits, "heap_secret": _heap_secret,
           "leftover_process": _leftover_process}


def _attack_then_probe(p, names, seed):
  """Runs the attacks `names` (in order) then the probe; returns (probe
  before, probe after)."""
  rng = random.Random(seed)
  keys, mqs, hashes, codes = [], [], [], []
  for name in names:
    code, k, m, h = ATTACKS[name](rng)
    keys += k
    mqs += m
    hashes += h
    codes.append(code)
  before = _probe(p, keys, mqs, hashes)
  for code in codes:
    r = p.run(code)
    assert not r.sandbox_error, r
  return before, _probe(p, keys, mqs, hashes)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_call_leaves_nothing_for_the_next(pool, attack):
  before, after = _attack_then_probe(pool, [attack], seed=len(attack))
  iso = _isolation(pool)
  if attack == "heap_secret" and not iso["pristine_server"]:
    # Said at start: without per-call namespaces the server reads each
    # request, and the next call is forked from it. True only if readable.
    if after["heap"] == "read":
      assert after["heap_secrets"] >= 1, after
    after["heap_secrets"] = before["heap_secrets"]
  assert after == before
  assert before["ipc"] == [False] * len(before["ipc"])
  assert before["heap_secrets"] == 0 and before["writable"]


def test_random_hostile_sequences_leave_nothing(pool):
  """Property: any sequence of hostile calls, then the probe sees what it
  saw before them (8 random sequences of 1-4 attacks)."""
  pristine = _isolation(pool)["pristine_server"]
  for seed in range(8):
    rng = random.Random(1000 + seed)
    names = [rng.choice(sorted(ATTACKS)) for _ in range(rng.randint(1, 4))]
    if not pristine:
      names = [n for n in names if n != "heap_secret"] or ["strip_dirs"]
    before, after = _attack_then_probe(pool, names, seed)
    assert after == before, (names, seed)


def test_the_servers_limits_are_not_inherited(pool):
  """After a call lowered every limit and priority it could reach, later
  calls still get the call's own limits and open 20 files."""
  code, _, _, _ = _server_limits(random.Random(0))
  pool.run(code)
  for _ in range(3):
    r = pool.run("import os, resource\n"
                 "fds = [os.open('/dev/null', 0) for _ in range(20)]\n"
                 "print(resource.getrlimit(resource.RLIMIT_NOFILE), "
                 "os.getpriority(os.PRIO_PROCESS, 0), len(fds))")
    assert r.exit_code == 0 and not r.sandbox_error, r
    assert r.stdout.startswith(f"({LIMITS.open_files}, {LIMITS.open_files})")
    assert r.stdout.split()[-1] == "20"


def test_a_host_segment_is_out_of_reach(pool):
  """A System V segment the host made with open permissions cannot be
  attached from inside (its own IPC namespace, or IPC denied)."""
  libc = ctypes.CDLL(None, use_errno=True)
  key = secrets.randbelow(1 << 29) + (1 << 29)
  shmid = libc.shmget(key, 4096, 0o1666)
  assert shmid >= 0
  try:
    r = pool.run(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 f"print(libc.shmget({key}, 0, 0))")
  finally:
    libc.shmctl(shmid, 0, None)  # IPC_RMID
  assert r.exit_code == 0 and r.stdout.strip() == "-1", r


@pytest.mark.parametrize("kind", ["landlock", "landlock_no_ns"])
def test_no_ipc_object_outlives_a_closed_sandbox(kind):
  """The fallback runs in the host's IPC namespace: what its calls made
  must not be there after the call (nor after close)."""
  p = _make(kind)
  key = secrets.randbelow(1 << 29) + (1 << 29)
  try:
    p.run(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          f"print(libc.shmget({key}, 1 << 16, 0o1666))")
    after_call = _host_keys()
  finally:
    p.close()
  assert key not in after_call and key not in _host_keys()


def _host_keys():
  with open("/proc/sysvipc/shm") as f:
    next(f)
    return {int(line.split()[0]) for line in f}


def test_scratch_size_is_held_where_said(pool):
  """Writing 4 MiB files until refused: the scratch holds at most its size
  where `isolation` says it is held (bwrap's tmpfs; the fallback's tmpfs
  where it could mount one)."""
  r = pool.run("""
import os
written = 0
try:
  for i in range(40):
    with open(f"f{i}", "wb") as f:
      f.write(b"x" * (4 << 20))
    written += 4
except OSError:
  pass
print(written)
""")
  held = int(r.stdout) <= LIMITS.scratch_mb
  assert held == _isolation(pool)["scratch_size"], r
  assert _probe(pool)["listing"][_probe_cwd(pool)] in ([], ["shm", "tmp"])


def _probe_cwd(p):
  return p.run("import os\nprint(os.getcwd())").stdout.strip()


def test_host_pids_are_hidden_with_namespaces(pool):
  r = pool.run(f"import os\ntry:\n  os.kill({os.getpid()}, 0)\n  print('seen')\n"
               "except ProcessLookupError:\n  print('none')\n"
               "except PermissionError:\n  print('seen')\n")
  hidden = _isolation(pool)["per_call_namespaces"] or (
      pool.mechanism == "bwrap")  # bwrap's own pid namespace.
  assert r.stdout.strip() == ("none" if hidden else "seen"), r


def test_shared_memory_left_behind_does_not_fill_the_next_call():
  """A call that leaves 400 MiB of System V memory must not get the next
  call, which touches 400 MiB, killed by the sandbox's memory cgroup."""
  probe_cg = cgroup.Cgroup.create(768, 16)
  probe_cg.close()
  if probe_cg.kind == "none":
    pytest.skip("no memory cgroup can be made here")
  limits = dataclasses.replace(LIMITS, memory_mb=700, wall_s=20.0, cpu_s=20)
  p = _make("bwrap", limits)
  try:
    fill = p.run("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(0x5a0, 400 << 20, 0o1600)
addr = libc.shmat(shmid, None, 0)
ctypes.memset(addr, 1, 400 << 20)
print(shmid >= 0)
""")
    nxt = p.run("b = bytearray(400 << 20)\nb[::4096] = b'x' * (100 << 10)\n"
                "print('ok')")
  finally:
    p.close()
  assert fill.stdout.strip() == "True", fill
  assert nxt.stdout.strip() == "ok" and not nxt.memory_error, nxt


def test_a_call_that_kills_its_server_is_a_sandbox_error():
  """Without per-call namespaces a call can kill its server: that call's
  result says sandbox error (counted), the worker is replaced, the next
  call runs. With them, the server is out of reach and nothing happens."""
  for kind, reached in (("bwrap_no_ns", True), ("bwrap", False)):
    p = _make(kind)
    try:
      r = p.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                "import time\ntime.sleep(1)\nprint('alive')")
      nxt = p.run("print(6 * 7)")
      errors = p.stats.counts["sandbox_errors"]
    finally:
      p.close()
    assert bool(r.sandbox_error) == reached, (kind, r)
    assert (r.stdout == "alive\n") == (not reached), (kind, r)
    assert nxt.stdout == "42\n" and not nxt.sandbox_error, (kind, nxt)
    assert errors == int(reached)


def test_a_venv_behind_a_symlink_under_tmp_starts(tmp_path):
  """The interpreter reached through a symlink under /tmp (the tmpfs the
  sandbox mounts there): its prefixes are bound where they are seen."""
  if probe.bwrap_problem() and not os.environ.get("CI"):
    pytest.skip(probe.bwrap_problem())
  link = tmp_path / "venv"
  link.symlink_to(sys.prefix)
  repo = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  code = ("from sao_jax.sandbox import SandboxPool\n"
          "with SandboxPool(mechanism='bwrap', preload=('numpy',)) as p:\n"
          "  print(p.workers[0].preloaded, p.run('import numpy; "
          "print(numpy.arange(4).sum())').stdout.strip())")
  out = subprocess.run([str(link / "bin" / "python"), "-c", code],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=repo), check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "['numpy'] 6", out  # The venv's numpy.


def test_a_server_that_cannot_start_says_why(monkeypatch):
  if probe.bwrap_problem() and not os.environ.get("CI"):
    pytest.skip(probe.bwrap_problem())
  monkeypatch.setattr(launcher, "interpreter",
                      lambda *_: ("/nonexistent/bin/python", []))
  with pytest.raises(SandboxError) as e:
    SandboxPool(LIMITS, mechanism="bwrap")
  assert "/nonexistent/bin/python" in str(e.value)
  assert "No such file" in str(e.value)
