"""SIGTERM inside ``segment.sigterm_unwinds()``: segments unlinked, then unwound.

The trainer's loop runs inside that block so a SIGTERM stops the sampler and
closes the checkpointer through its ``finally`` clauses.
"""

import multiprocessing as mp
import os
import signal
import time

import pytest

from sao_jax.ipc import segment

_SPAWN = mp.get_context("spawn")


def _unwind_on_sigterm(q):
  shm = segment.create("test", 4096)
  try:
    with segment.sigterm_unwinds():
      q.put(shm.name)
      for _ in range(600):  # Short sleeps: handlers run between bytecodes.
        time.sleep(0.1)
  except KeyboardInterrupt:
    # The handler unlinked the segment before raising.
    os._exit(5 if not os.path.exists(segment.shm_path(shm.name)) else 6)
  os._exit(0)


def _deferred_sigterm(q):
  shm = segment.create("test", 4096)
  done = 0
  try:
    with segment.sigterm_unwinds():
      with segment.sigterm_deferred():
        q.put(shm.name)
        for _ in range(30):  # The signal arrives here: the block finishes.
          time.sleep(0.1)
        done = 1
      for _ in range(600):
        time.sleep(0.1)
  except KeyboardInterrupt:
    unlinked = not os.path.exists(segment.shm_path(shm.name))
    os._exit(7 if done and unlinked else 8)
  os._exit(0)


@pytest.mark.multiprocess
def test_sigterm_inside_a_deferred_block_unwinds_when_it_ends():
  q = _SPAWN.Queue()
  p = _SPAWN.Process(target=_deferred_sigterm, args=(q,))
  p.start()
  try:
    q.get(timeout=60)
    os.kill(p.pid, signal.SIGTERM)
    p.join(60)
  finally:
    if p.is_alive():
      p.kill()
  assert p.exitcode == 7


@pytest.mark.multiprocess
def test_sigterm_unlinks_then_unwinds_inside_the_block():
  q = _SPAWN.Queue()
  p = _SPAWN.Process(target=_unwind_on_sigterm, args=(q,))
  p.start()
  try:
    name = q.get(timeout=60)
    assert os.path.exists(segment.shm_path(name))
    os.kill(p.pid, signal.SIGTERM)
    p.join(timeout=30)
    assert p.exitcode == 5  # KeyboardInterrupt raised, segment already gone.
    assert not os.path.exists(segment.shm_path(name))
  finally:
    if p.is_alive():
      p.kill()
      p.join()


def test_sigterm_unwinds_needs_the_main_thread():
  import threading  # pylint: disable=g-import-not-at-top
  errors = []

  def enter():
    try:
      with segment.sigterm_unwinds():
        pass
    except RuntimeError as e:
      errors.append(str(e))

  t = threading.Thread(target=enter)
  t.start()
  t.join()
  assert errors and "main thread" in errors[0]


def _dead_pid() -> int:
  """The pid of a process that has exited (and been reaped)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")
def test_reap_orphans_removes_only_dead_creators_segments():
  dead = _dead_pid()
  orphan = f"/dev/shm/sao_ring_{dead}_deadbeef"
  live = f"/dev/shm/sao_w_{os.getpid()}_cafebabe"
  foreign = "/dev/shm/sao_ring_12_notours"  # Not our name pattern.
  made = [p for p in (orphan, live, foreign) if not os.path.exists(p)]
  try:
    for path in made:
      with open(path, "w") as f:
        f.write("x")
    assert segment.reap_orphans() >= 1
    assert not os.path.exists(orphan)
    assert os.path.exists(live) and os.path.exists(foreign)
  finally:
    for path in made:
      if os.path.exists(path):
        os.unlink(path)


def test_reap_orphans_takes_a_directory_and_a_pattern(tmp_path):
  import re  # pylint: disable=g-import-not-at-top
  dead = _dead_pid()
  (tmp_path / f"sao_vllm_{dead}_x1y2").mkdir()
  (tmp_path / f"sao_vllm_{dead}_x1y2" / "config.json").write_text("{}")
  (tmp_path / f"sao_vllm_{os.getpid()}_a1").mkdir()
  (tmp_path / f"sao_vllm_{dead}.safetensors").write_bytes(b"")
  pattern = re.compile(r"^sao_vllm_([0-9]+)_\w+$")
  assert segment.reap_orphans(str(tmp_path), pattern, 1) == 1
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      [f"sao_vllm_{os.getpid()}_a1", f"sao_vllm_{dead}.safetensors"])
  assert segment.reap_orphans(str(tmp_path / "missing"), pattern, 1) == 0


def test_the_suite_keeps_orphans_for_its_leak_check():
  # conftest sets it for every test process and child: a reaping create()
  # would hide the leaks no_leaked_shared_memory must see.
  assert os.environ.get(segment.KEEP_ORPHANS_ENV) == "1"


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="Linux /dev/shm")
def test_a_run_reaps_orphans_at_its_first_segment():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  orphan = f"/dev/shm/sao_ring_{_dead_pid()}_0badf00d"
  with open(orphan, "w") as f:
    f.write("x")
  try:
    env = {k: v for k, v in os.environ.items()
           if k != segment.KEEP_ORPHANS_ENV}
    subprocess.run([sys.executable, "-c", (
        "from sao_jax.ipc import segment\n"
        "s = segment.create('ring', 64)\n"
        "s.close(); s.unlink()\n")], check=True, env=env, timeout=60)
    assert not os.path.exists(orphan)
  finally:
    if os.path.exists(orphan):
      os.unlink(orphan)
