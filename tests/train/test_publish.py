"""The trainer's weight publisher: held-back versions (the staleness study's
lag), in memory or spilled to disk."""

import os

import jax
import ml_dtypes
import numpy as np
import pytest

from sao_jax.train import publish as publish_lib


class _FakeSlot:

  def __init__(self):
    self.published = []

  def publish(self, params, version):
    self.published.append((version, float(params["w"])))
    return 0.0


@pytest.mark.parametrize("lag,expected", [
    (0, [0, 1, 2, 3, 4, 5]),
    (2, [0, 1, 2, 3]),  # v0 at start; then v-2 once v >= 2.
    (4, [0, 1]),
])
@pytest.mark.parametrize("spill", [False, True])
def test_publisher_holds_weights_back(lag, expected, spill, tmp_path):
  slot = _FakeSlot()
  spill_dir = str(tmp_path / "held") if spill else None
  publish = publish_lib.Publisher(slot, lag, spill_dir=spill_dir)
  for v in range(6):
    publish({"w": np.float32(v)}, v)
    if spill and lag:  # On disk: the versions not yet published, no more.
      assert len(os.listdir(spill_dir)) == min(v, lag)
  assert [v for v, _ in slot.published] == expected
  # Each version carries its own weights, not the newest ones.
  assert all(v == w for v, w in slot.published)
  publish.close()
  assert not spill or not os.path.exists(spill_dir)


@pytest.mark.parametrize("spill", [False, True])
def test_a_version_repeated_is_held_once(spill, tmp_path):
  """The critic's warm-up steps publish version 0 again and again (the policy
  does not move): each version is published once, with its own weights, and
  a repeat never deletes what a held copy still needs (a spilled v0 released
  as superseded under its twin crashed a run at eta = 16)."""
  slot = _FakeSlot()
  spill_dir = str(tmp_path / "held") if spill else None
  publish = publish_lib.Publisher(slot, 2, spill_dir=spill_dir)
  # Version published -> copies on disk: one per version not yet published.
  for v, on_disk in zip([0, 0, 0, 1, 1, 2, 3, 4, 5],
                        [0, 0, 0, 1, 1, 2, 2, 2, 2]):
    publish({"w": np.float32(v)}, v)
    if spill:
      assert len(os.listdir(spill_dir)) == on_disk, v
  assert [v for v, _ in slot.published] == [0, 1, 2, 3]
  assert all(v == w for v, w in slot.published)
  publish.close()


def test_spilled_weights_come_back_bit_for_bit(tmp_path):
  class Slot:
    def publish(self, params, version):
      self.got = (version, jax.tree.map(np.array, params))
      return 0.0

  slot = Slot()
  (tmp_path / "held" / "v9").mkdir(parents=True)  # A killed run's leftover.
  publish = publish_lib.Publisher(slot, 1, spill_dir=str(tmp_path / "held"))
  assert os.listdir(tmp_path / "held") == []
  rng = np.random.default_rng(0)
  trees = [{"a": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
            "b": {"c": np.asarray(rng.standard_normal(), np.float32),
                  "d": np.zeros((0, 4), np.float32),
                  "e": rng.standard_normal((2, 3)).astype(np.float32).T}}
           for _ in range(3)]
  for v, tree in enumerate(trees):
    publish(tree, v)
  version, got = slot.got
  assert version == 1
  for want, have in zip(jax.tree.leaves(trees[1]), jax.tree.leaves(got)):
    assert have.dtype == want.dtype and have.shape == want.shape
    np.testing.assert_array_equal(have, want)
