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
