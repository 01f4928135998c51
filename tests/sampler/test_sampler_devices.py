"""sampler.chips: the environment the trainer and the sampler process get."""

import os

import pytest

from sao_jax import config_validation
from sao_jax import tpu_topology as topology
from sao_jax.sampler import devices
from configs import base


def test_no_split_sets_nothing():
  assert devices.process_env("", "trainer") == {}
  assert devices.process_env("", "sampler") == {}


def test_v5e8_half_and_half():
  sampler = devices.process_env("v5e-8:4-7", "sampler")
  trainer = devices.process_env("v5e-8:4-7", "trainer")
  assert sampler["TPU_VISIBLE_CHIPS"] == "4,5,6,7"
  assert sampler["TPU_VISIBLE_DEVICES"] == "4,5,6,7"
  assert trainer["TPU_VISIBLE_CHIPS"] == "0,1,2,3"
  # A v5e host is 2x4 chips; each half is a 2x2 block.
  assert sampler["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
  assert trainer["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
  for env in (sampler, trainer):
    assert env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "true"
  # Each process has its own ports on the host.
  assert sampler["TPU_PROCESS_PORT"] != trainer["TPU_PROCESS_PORT"]
  assert (sampler["TPU_MESH_CONTROLLER_PORT"] !=
          trainer["TPU_MESH_CONTROLLER_PORT"])
  assert sampler["TPU_PROCESS_ADDRESSES"] == (
      f"localhost:{sampler['TPU_PROCESS_PORT']}")


def test_v5p_pair():
  # v5p-8: 4 chips (2x2x1) on one host; 2 each.
  s = devices.process_env("v5p-8:2,3", "sampler")
  t = devices.process_env("v5p-8:2,3", "trainer")
  assert (s["TPU_VISIBLE_CHIPS"], t["TPU_VISIBLE_CHIPS"]) == ("2,3", "0,1")
  assert s["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,1,1"
  assert t["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,1,1"


@pytest.mark.parametrize("spec, words", [
    ("v5e-8:1,2", "not a block"),  # (1,0) and (0,1): not neighbours in a box.
    ("v5e-8:6,7", "not a block"),  # Leaves the trainer 6 chips (2x3).
    ("v5e-8:0-7", "every chip"),
    ("v5e-8:8", "no chip 8"),
    ("v5e-3:0", "no slice"),
    ("v7x-8:0", "unknown TPU slice"),
    ("v5e-8:a", "expected ids"),
    ("4-7", "expected 'gpu:IDS' or 'SLICE:IDS'"),
])
def test_invalid_splits_refused(spec, words):
  with pytest.raises(devices.ChipsError, match=words):
    devices.parse_chips(spec)


def test_validation_refuses_an_invalid_split():
  config = base.get_config()
  config.sampler.chips = "v5e-8:1,2"
  with pytest.raises(config_validation.ConfigError,
                     match=r"config\.sampler\.chips='v5e-8:1,2'.*not a block"):
    config_validation.validate_config(config)
  config.sampler.chips = "v5e-8:4-7"
  config_validation.validate_config(config)  # A valid split passes.


def test_multi_host_trainer_needs_the_hosts():
  with pytest.raises(devices.ChipsError, match="TPU_WORKER_HOSTNAMES"):
    devices.process_env("v5e-16:4-7", "trainer", environ={})
  env = devices.process_env(
      "v5e-16:4-7", "trainer",
      environ={"TPU_WORKER_HOSTNAMES": "10.0.0.1,10.0.0.2"})
  # v5e-16 is 4x4 chips: two 2x4 hosts side by side along x.
  assert env["TPU_PROCESS_BOUNDS"] == "2,1,1"
  assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
  assert env["TPU_PROCESS_ADDRESSES"] == "10.0.0.1:8476,10.0.0.2:8476"
  # Each host's sampler stays a process of its own.
  sampler = devices.process_env("v5e-16:4-7", "sampler", environ={})
  assert sampler["TPU_PROCESS_BOUNDS"] == "1,1,1"


def test_gpu_split_indexes_the_jobs_gpus():
  environ = {"CUDA_VISIBLE_DEVICES": "2,3,5,7"}
  assert devices.process_env("gpu:3", "sampler", environ) == {
      "CUDA_VISIBLE_DEVICES": "7"}
  assert devices.process_env("gpu:3", "trainer", environ) == {
      "CUDA_VISIBLE_DEVICES": "2,3,5"}
  assert devices.process_env("gpu:0-1", "trainer", environ) == {
      "CUDA_VISIBLE_DEVICES": "5,7"}
  with pytest.raises(devices.ChipsError, match="this job has 4 GPUs"):
    devices.process_env("gpu:4", "sampler", environ)
  with pytest.raises(devices.ChipsError, match="leaving the trainer"):
    devices.process_env("gpu:0-3", "sampler", environ)


def test_apply_sets_the_environment(monkeypatch):
  monkeypatch.setattr(devices, "_backend_initialized", lambda: False)
  for key in devices.process_env("v5e-8:4-7", "sampler"):
    monkeypatch.setenv(key, "unset")  # Restored after the test.
  got = devices.apply("v5e-8:4-7", "sampler")
  assert os.environ["TPU_VISIBLE_CHIPS"] == "4,5,6,7"
  assert got["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"


def test_apply_refuses_after_backend_init(monkeypatch):
  monkeypatch.setattr(devices, "_backend_initialized", lambda: True)
  with pytest.raises(RuntimeError, match="already initialised"):
    devices.apply("v5e-8:4-7", "trainer")
  assert devices.apply("", "trainer") == {}  # No split: nothing to do.


def test_topology_names():
  t = topology.parse("v5p-64")
  assert (t.chips, t.shape, t.num_hosts) == (32, (2, 4, 4), 8)
  assert topology.grid_name(t.family, t.shape) == "v5:2x4x4"
  t = topology.parse("v5e-8")
  assert (t.chips, t.num_hosts, t.host_shape) == (8, 1, (2, 4, 1))
  assert topology.grid_name(t.family, t.shape) == "v5e:2x4"
  t = topology.parse("v4-16")
  assert (t.chips, t.shape, t.host_bounds) == (8, (2, 2, 2), (1, 1, 2))
  assert topology.parse("v6e-16").host_bounds == (2, 1, 1)
  assert topology.block_shape([4, 5, 6, 7], (2, 4, 1)) == (2, 2, 1)
  assert topology.block_shape([1, 2], (2, 4, 1)) is None


@pytest.mark.parametrize("chips,sizes,want", [
    ("", (1, 1, 0), (1, 1, 1)),  # No split: the sampler's first device.
    ("v5e-8:4-7", (1, 1, 0), (1, 1, -1)),  # Its whole block, tensor.
    ("gpu:1,2", (2, 1, 0), (2, 1, -1)),
    ("v5e-8:4-7", (-1, 1, 0), (-1, 1, 1)),  # data already fills.
    ("v5e-8:4-7", (1, 1, 2), (1, 1, 2)),  # Explicit sizes stay.
    ("", (1, 1, -1), (1, 1, -1)),
])
def test_sampler_mesh_tensor_auto_takes_the_block(chips, sizes, want):
  from sao_jax.sampler import mesh  # pylint: disable=g-import-not-at-top
  config = base.get_config()
  assert tuple(config.sampler.mesh[a] for a in mesh.FIELDS) == (1, 1, 0)
  config.sampler.chips = chips
  for axis, size in zip(mesh.FIELDS, sizes):
    config.sampler.mesh[axis] = size
  assert mesh.mesh_sizes(config) == want
  config_validation.validate_config(config)


def test_validation_refuses_two_filling_sampler_mesh_sizes():
  config = base.get_config()
  config.sampler.mesh.data, config.sampler.mesh.expert = -1, -1
  with pytest.raises(config_validation.ConfigError,
                     match="at most one -1; tensor 0: auto"):
    config_validation.validate_config(config)
