"""sao_jax.sandbox beyond attacks: mechanism choice and refusal, warm state
wiped between calls, results, limits."""

import os

import pytest

from sao_jax.sandbox import Limits
from sao_jax.sandbox import SandboxPool
from sao_jax.sandbox import probe
from sao_jax.sandbox import SandboxUnavailable


def _no_mechanism(monkeypatch):
  monkeypatch.setattr(probe, "bwrap_problem",
                      lambda: "bwrap: not installed (apt-get install bubblewrap)")
  monkeypatch.setattr(probe, "landlock_problem",
                      lambda: "landlock: not enabled in this kernel")
  monkeypatch.setattr(probe, "seccomp_problem", lambda: "")


def test_refusal_names_what_is_missing_and_the_override(monkeypatch):
  _no_mechanism(monkeypatch)
  with pytest.raises(SandboxUnavailable) as e:
    probe.choose_mechanism("auto")
  message = str(e.value)
  for part in ("bwrap: not installed", "landlock: not enabled",
               probe.OVERRIDE_FLAG):
    assert part in message
  assert probe.choose_mechanism("unsafe_subprocess") == "unsafe_subprocess"
  with pytest.raises(ValueError, match="use one of"):
    probe.choose_mechanism("docker")


def test_fallback_is_chosen_only_by_name(monkeypatch):
  """Without bwrap, 'auto' refuses and names the weaker fallback's flag
  (issue 38 item 3); asked for by name, the fallback is chosen."""
  monkeypatch.setattr(probe, "bwrap_problem", lambda: "bwrap: missing")
  monkeypatch.setattr(probe, "landlock_problem", lambda: "")
  monkeypatch.setattr(probe, "seccomp_problem", lambda: "")
  with pytest.raises(SandboxUnavailable) as e:
    probe.choose_mechanism("auto")
  assert "bwrap: missing" in str(e.value)
  assert probe.FALLBACK_FLAG in str(e.value)
  assert "fewer guarantees" in str(e.value)
  assert probe.choose_mechanism("landlock") == "landlock"
  monkeypatch.setattr(probe, "bwrap_problem", lambda: "")
  assert probe.choose_mechanism("auto") == "bwrap"
  with pytest.raises(SandboxUnavailable, match="bwrap: missing"):
    monkeypatch.setattr(probe, "bwrap_problem", lambda: "bwrap: missing")
    probe.choose_mechanism("bwrap")


def test_limits_are_checked():
  with pytest.raises(ValueError, match="wall_s"):
    Limits(wall_s=0)
  assert Limits(total_memory_mb=0).total_memory_mb == 0


@pytest.fixture(params=["bwrap", "landlock"])
def warm_pool(request):
  problem = (probe.bwrap_problem() if request.param == "bwrap"
             else probe.landlock_problem())
  if problem and not (os.environ.get("CI") and request.param == "bwrap"):
    pytest.skip(problem)
  pool = SandboxPool(Limits(wall_s=2.0, cpu_s=2), workers=1, mode="warm",
                     mechanism=request.param)
  yield pool
  pool.close()


@pytest.mark.multiprocess
def test_warm_state_is_wiped_between_calls(warm_pool):
  assert warm_pool.mechanism in ("bwrap", "landlock")
  first = warm_pool.run("""
import builtins, os, tempfile
print(sorted(os.listdir(tempfile.gettempdir())))  # A checkout under /tmp
builtins.LEAK = 1  # shows its directory, bound there (e.g. /tmp/sao_jax).
x = 41
open("scratch_file", "w").write("x")
open(os.path.join(tempfile.gettempdir(), "tmp_file"), "w").write("x")
os.makedirs("sub/dir")
print(len(os.listdir(".")), x + 1)
""")
  entries = 2 if warm_pool.mechanism == "bwrap" else 4  # + tmp/, shm/.
  fresh_tmp = first.stdout.splitlines()[0]
  assert (first.exit_code, first.stdout) == (
      0, f"{fresh_tmp}\n{entries} 42\n"), first
  second = warm_pool.run("""
import builtins, os, tempfile
print(hasattr(builtins, "LEAK"), "x" in globals(), sorted(os.listdir(".")),
      sorted(os.listdir(tempfile.gettempdir())))
""")
  names = "[]" if warm_pool.mechanism == "bwrap" else "['shm', 'tmp']"
  assert second.stdout == f"False False {names} {fresh_tmp}\n", second
  assert "tmp_file" not in fresh_tmp


@pytest.mark.multiprocess
def test_result_fields(warm_pool):
  r = warm_pool.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
                    "sys.exit(3)")
  assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.truncated) == (
      "out\n", "err\n", 3, False, False)
  r = warm_pool.run("raise ValueError('bad')")
  assert r.exit_code == 1 and r.stderr.endswith("ValueError: bad\n")
  r = warm_pool.run("import time\ntime.sleep(10)")
  assert r.timed_out and r.exit_code == -9 and 2.0 <= r.exec_s < 3.0
  assert warm_pool.stats.counts["timeouts"] == 1
  assert warm_pool.stats.counts["calls"] == 3



def _bwrap_or_skip():
  problem = probe.bwrap_problem() or probe.seccomp_problem()
  if problem and not os.environ.get("CI"):
    pytest.skip(problem)


@pytest.mark.multiprocess
def test_strict_calls_get_a_fresh_sandbox_started_ahead():
  """Strict mode: the sandbox for the next call is up before the call
  (started while the caller went on), each call's sandbox is gone when the
  call returns, and nothing a call did reaches the next."""
  _bwrap_or_skip()
  pool = SandboxPool(Limits(wall_s=2.0, cpu_s=2), workers=1, mode="strict",
                     mechanism="bwrap")
  try:
    (worker,) = pool.workers
    bwraps, outs = [], []
    for i in range(4):
      pool._wait_for_starts()  # pylint: disable=protected-access
      assert worker.started  # Before the call asks for it.
      bwraps.append(worker._launched.proc.pid)  # pylint: disable=protected-access
      outs.append(pool.run(f"""
import os
print(sorted(os.listdir(".")), os.getpid())
open("mark_{i}", "w").write("x")
""").stdout.split("]")[0] + "]")
      # That call's sandbox: gone (killed and reaped).
      assert not os.path.exists(f"/proc/{bwraps[-1]}")
  finally:
    pool.close()
  assert len(set(bwraps)) == 4
  assert outs == ["[]"] * 4  # No call sees an earlier call's file.


def test_a_pool_whose_sandboxes_cannot_start_says_so(monkeypatch):
  _bwrap_or_skip()
  from sao_jax.sandbox import launcher  # pylint: disable=import-outside-toplevel
  from sao_jax.sandbox import pool as pool_lib  # pylint: disable=import-outside-toplevel

  def fail(*_):
    raise pool_lib.SandboxError("the bwrap sandbox did not start: no bwrap")

  monkeypatch.setattr(launcher, "launch", fail)
  for mode in ("warm", "strict"):
    with pytest.raises(pool_lib.SandboxError, match="did not start"):
      SandboxPool(Limits(), workers=2, mode=mode, mechanism="bwrap")


@pytest.mark.multiprocess
def test_wipe_keeps_mounts_and_the_directories_above_them(tmp_path):
  """The bwrap sandbox binds the interpreter's prefixes at their own paths, so
  a checkout under /tmp puts /tmp/<checkout>/.venv (a mount) in the wiped
  /tmp: the wipe removes what a call made around it and keeps the mount and
  the directories leading to it (it used to report the sandbox spoiled and
  restart it after every call)."""
  import shutil  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  if not shutil.which("unshare"):
    pytest.skip("unshare (util-linux) is not installed")
  root = tmp_path / "tmp"
  script = f"""
import os, subprocess, sys
from sao_jax.sandbox import confine
root = {str(root)!r}
os.makedirs(root + "/checkout/.venv")
subprocess.run(["mount", "-t", "tmpfs", "none", root + "/checkout/.venv"],
               check=True)
open(root + "/checkout/.venv/python", "w").write("x")
os.makedirs(root + "/checkout/made/deep")
open(root + "/checkout/made/deep/f", "w").write("x")
open(root + "/checkout/file", "w").write("x")
os.makedirs(root + "/other")
os.chmod(root + "/checkout", 0o500)
clean = confine.wipe([(root, 0o755)])
print(clean, sorted(os.listdir(root)), sorted(os.listdir(root + "/checkout")),
      os.listdir(root + "/checkout/.venv"))
"""
  os.makedirs(root)
  out = subprocess.run(["unshare", "-rm", sys.executable, "-c", script],
                       capture_output=True, text=True, check=False,
                       cwd=os.path.dirname(os.path.dirname(
                           os.path.dirname(os.path.abspath(__file__)))))
  if out.returncode and "Operation not permitted" in out.stderr:
    pytest.skip(f"no user namespaces here: {out.stderr[-200:]}")
  assert out.stdout == "True ['checkout'] ['.venv'] ['python']\n", out.stderr
