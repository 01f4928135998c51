"""Tests for experiments/bench/ring_routing.py (record bytes with experts)."""

import pathlib
import sys

import numpy as np
import pytest

from sao_jax.data import trajectory as codec

_BENCH = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench"


# Imported by name (not by path) so that the ring's spawned producer process
# can import it too (spawn passes sys.path on).
if str(_BENCH) not in sys.path:
  sys.path.insert(0, str(_BENCH))
import ring_routing as bench  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.parametrize("m,k", [(0, 0), (4, 2), (48, 8)])
def test_record_bytes_are_the_fields_and_the_experts(m, k):
  t = 100
  traj = bench._routed_trajectory(t, m, k)
  nbytes = sum(memoryview(b).nbytes for b in codec.encode(traj))
  # Header, 4 four-byte fields and the mask a token, uint16 experts, task.
  assert nbytes == codec.HEADER_BYTES + 17 * t + 2 * m * k * t + len(
      "reasoning_gym")
  back = codec.decode(b"".join(bytes(memoryview(b)) for b in
                                codec.encode(traj)))
  if m:
    np.testing.assert_array_equal(back.routed_experts, traj.routed_experts)
  else:
    assert back.routed_experts is None


@pytest.mark.multiprocess
def test_records_cross_the_ring_whole():
  traj = bench._routed_trajectory(64, 48, 8)
  assert bench.run_routing(traj, 8) > 0  # Asserts each record's length.
