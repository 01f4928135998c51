"""Tests of the versioned shared-memory weight slot (sao_jax/ipc/weights.py)."""

import multiprocessing as mp
import os
import stat

import jax
import ml_dtypes
import numpy as np
import pytest

from sao_jax.ipc import segment
from sao_jax.ipc import weights

_SPAWN = mp.get_context("spawn")


def _tree(fill: float = 0.0):
  return {
      "embed": np.full((64, 32), fill, np.float32),
      "layers": [
          {"w": np.full((32, 48), fill, np.float32),
           "b": np.full((48,), fill, np.float32)},
          {"w": np.full((48, 32), fill, np.float32),
           "count": np.full((3,), int(fill), np.int32)},
      ],
  }


def test_round_trip_keeps_structure_values_and_versions():
  rng = np.random.default_rng(0)
  tree = jax.tree.map(
      lambda x: rng.normal(size=x.shape).astype(x.dtype), _tree())
  with weights.WeightSlot.create(_tree()) as slot:
    assert stat.S_IMODE(os.stat(segment.shm_path(slot.name)).st_mode) == 0o600
    assert slot.read() is None and slot.latest_version() == -1
    slot.publish(tree, version=11)
    with weights.WeightSlot.attach(slot.name, template=_tree()) as reader:
      version, got = reader.read()
      assert version == 11 == reader.latest_version()
      assert jax.tree.structure(got) == jax.tree.structure(tree)
      jax.tree.map(np.testing.assert_array_equal, got, tree)
      slot.publish(jax.tree.map(lambda x: x + 1, tree), version=12)
      version, got = reader.read()
      assert version == 12
      np.testing.assert_array_equal(got["layers"][1]["count"],
                                    tree["layers"][1]["count"] + 1)
    flat = weights.WeightSlot.attach(slot.name).read()[1]  # No template.
    assert sorted(flat) == sorted(
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    np.testing.assert_array_equal(flat["['embed']"], tree["embed"] + 1)
  assert not os.path.exists(segment.shm_path(slot.name))


def test_bf16_leaves_round_trip_in_their_dtype():
  rng = np.random.default_rng(1)
  tree = jax.tree.map(
      lambda x: rng.normal(size=x.shape).astype(x.dtype), _tree())
  tree["embed"] = tree["embed"].astype(ml_dtypes.bfloat16)
  f32 = weights.WeightSlot.create(_tree())
  with weights.WeightSlot.create(tree) as slot:
    assert f32.nbytes - slot.nbytes == 64 * 32 * 2  # The bf16 leaf: half.
    f32.close()
    slot.publish(tree, version=1)
    _, got = slot.read()
  assert got["embed"].dtype == ml_dtypes.bfloat16
  assert got["layers"][1]["count"].dtype == np.int32
  np.testing.assert_array_equal(got["embed"], tree["embed"])


def test_mismatched_template_and_tree_are_rejected():
  with weights.WeightSlot.create(_tree()) as slot:
    bad = _tree()
    bad["embed"] = np.zeros((64, 33), np.float32)
    with pytest.raises(ValueError, match=r"first difference.*\['embed'\]"):
      weights.WeightSlot.attach(slot.name, template=bad)
    with pytest.raises(ValueError, match="has shape"):
      slot.publish(bad, version=0)
    with pytest.raises(ValueError, match="got 1 leaves"):
      slot.publish({"x": np.zeros(1)}, version=0)
    slot.publish(_tree(3.0), version=3)  # A failed publish left it usable.
    version, got = slot.read()
  assert version == 3 and float(got["embed"][0, 0]) == 3.0


# --- a reader in another process while the writer publishes -------------------

_N_VERSIONS = 200


def _big_tree(fill: float):
  return {
      "a": np.full((1024, 1024), fill, np.float32),  # 4 MiB
      "b": [np.full((100_000,), int(fill), np.int32),
            np.full((7,), fill, np.float64)],
  }


def _poll(name, ready, out):
  versions, mixed = [], 0
  with weights.WeightSlot.attach(name, template=_big_tree(0.0)) as slot:
    ready.set()
    while not versions or versions[-1] < _N_VERSIONS - 1:
      got = slot.read(timeout=60)
      if got is None:
        continue
      version, tree = got
      if not all(x.min() == x.max() == version for x in jax.tree.leaves(tree)):
        mixed += 1
      versions.append(version)
    out.put((versions, mixed, slot.retries))


@pytest.mark.multiprocess
def test_reader_never_sees_a_mix_of_versions():
  ready, out = _SPAWN.Event(), _SPAWN.Queue()
  with weights.WeightSlot.create(_big_tree(0.0)) as slot:
    p = _SPAWN.Process(target=_poll, args=(slot.name, ready, out))
    p.start()
    try:
      assert ready.wait(60)
      for v in range(_N_VERSIONS):
        slot.publish(_big_tree(float(v)), version=v)
      versions, mixed, retries = out.get(timeout=120)
    finally:
      p.join(timeout=60)
  assert p.exitcode == 0
  assert mixed == 0
  assert versions[-1] == _N_VERSIONS - 1
  assert all(a <= b for a, b in zip(versions, versions[1:]))  # Monotone.
  assert len(set(versions)) >= 3  # The reader really overlapped the writer.
