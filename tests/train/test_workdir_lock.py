"""One run per workdir (sao_jax/train/workdir_lock.py;
docs/design/failures.md)."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from sao_jax.train import workdir_lock

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_second_lock_refuses_naming_the_holder_until_released(tmp_path):
  workdir = tmp_path / "run"
  first = workdir_lock.acquire(str(workdir), 0, 1)
  assert first.workdir == str(workdir) and os.path.isdir(workdir)
  record = json.loads((workdir / workdir_lock.LOCK_NAME).read_text())
  assert record["pid"] == os.getpid()
  assert record["host"] == socket.gethostname()
  assert record["released"] is False
  with pytest.raises(workdir_lock.WorkdirInUseError) as e:
    workdir_lock.acquire(str(workdir), 0, 1)
  message = str(e.value)
  assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
  assert record["started"] in message
  assert "--workdir" in message  # What to do.
  first.release()
  first.release()  # Idempotent.
  assert json.loads(
      (workdir / workdir_lock.LOCK_NAME).read_text())["released"] is True
  second = workdir_lock.acquire(str(workdir), 0, 1)  # Free again.
  second.release()


def test_other_processes_of_a_run_take_no_lock(tmp_path):
  """Process 0 alone holds the file; a peer's handle releases nothing."""
  held = workdir_lock.acquire(str(tmp_path), 0, 1)
  try:
    peer = workdir_lock.acquire(str(tmp_path), 1, 1)
    assert peer.fd is None
    peer.release()
    with pytest.raises(workdir_lock.WorkdirInUseError):
      workdir_lock.acquire(str(tmp_path), 0, 1)
  finally:
    held.release()


_HOLDER = textwrap.dedent("""
    import sys, time
    from sao_jax.train import workdir_lock
    workdir_lock.acquire(sys.argv[1], 0, 1)
    print("HELD", flush=True)
    time.sleep(600)
""")


@pytest.mark.multiprocess
def test_a_sigkilled_holder_never_blocks_the_next_run(tmp_path):
  holder = subprocess.Popen(
      [sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=REPO,
      stdout=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=REPO))
  try:
    assert holder.stdout.readline().strip() == "HELD"
    with pytest.raises(workdir_lock.WorkdirInUseError,
                       match=f"pid {holder.pid} on host"):
      workdir_lock.acquire(str(tmp_path), 0, 1)
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
  finally:
    holder.kill()
    holder.wait(30)
  # Its record still says it holds the lock; the kernel dropped the flock.
  stale = json.loads((tmp_path / workdir_lock.LOCK_NAME).read_text())
  assert stale["pid"] == holder.pid and stale["released"] is False
  lock = workdir_lock.acquire(str(tmp_path), 0, 1)
  assert json.loads(
      (tmp_path / workdir_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
  lock.release()


def test_without_flock_a_live_holder_on_this_host_still_refuses(
    tmp_path, monkeypatch):
  """A filesystem without flock: the record decides (live pid: refuse;
  dead pid or released: take over)."""
  def no_flock(fd, op):
    raise OSError(workdir_lock.errno.ENOLCK, "No locks available")
  monkeypatch.setattr(workdir_lock.fcntl, "flock", no_flock)
  path = tmp_path / workdir_lock.LOCK_NAME
  path.write_text(json.dumps(workdir_lock.holder_record()))  # This process.
  with pytest.raises(workdir_lock.WorkdirInUseError, match="in use"):
    workdir_lock.acquire(str(tmp_path), 0, 1)
  dead = dict(workdir_lock.holder_record(), pid=2 ** 22 + 12345)
  path.write_text(json.dumps(dead))
  lock = workdir_lock.acquire(str(tmp_path), 0, 1)
  lock.release()
  assert json.loads(path.read_text())["released"] is True
  workdir_lock.acquire(str(tmp_path), 0, 1).release()  # Released: free.
  other_host = dict(workdir_lock.holder_record(), host="another-host")
  path.write_text(json.dumps(other_host))
  with pytest.raises(workdir_lock.WorkdirInUseError, match="another-host"):
    workdir_lock.acquire(str(tmp_path), 0, 1)
