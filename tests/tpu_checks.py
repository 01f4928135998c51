"""Test bodies that need TPU compile-only devices (libtpu), each run in a
fresh interpreter by tests/fresh_process.py so that libtpu never loads in
the pytest process (tests/aot/test_aot.py, tests/models/test_attention.py call them)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from sao_jax import tpu_topology as topology
from sao_jax.models import transformer as tm
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import attention


def _tpu_device():
  """A device of an abstract TPU v5e topology (libtpu, no TPU needed)."""
  return topology.compile_devices("v5e", (2, 2, 1))[0]


def devices_and_meshes_of_each_process():
  # pylint: disable=g-import-not-at-top
  from configs import qwen2_5_7b
  from configs import smollm2
  from sao_jax import sharding
  from sao_jax.aot import check
  # pylint: enable=g-import-not-at-top
  config = smollm2.get_config()
  two = check.place(config, topology.parse("v5e-8"), num_slices=2)
  assert len(two.trainer) == 16 and two.shared
  with pytest.raises(sharding.MeshError, match="multiple of the 2 slices"):
    sharding.make_mesh(config.mesh, two.trainer)
  config.mesh.data = 2  # The data axis spans the slices.
  mesh = sharding.make_mesh(config.mesh, two.trainer)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 8, "tensor": 1}
  assert [d.slice_index for d in mesh.devices[:, 0, 0]] == [0, 1]
  assert {d.slice_index for d in mesh.devices[0].flat} == {0}

  config = qwen2_5_7b.get_config("8k")  # sampler.chips = 'v5p-64:2,3'.
  topo = topology.parse("v5p-64")
  split = check.place(config, topo)
  assert not split.shared
  # Chips 0 and 1 of each of the 8 hosts: not a box of the slice.
  assert len(split.trainer) == 16
  assert {topology.local_chip(d, topo) for d in split.trainer} == {0, 1}
  assert len({d.process_index for d in split.trainer}) == 8
  mesh = sharding.make_mesh(config.mesh, split.trainer)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 16, "tensor": 1}
  # Its 2 chips of a host, as libtpu presents them to the sampler process
  # (a topology of their own): sampler.mesh lays its programs over them.
  assert len(split.sampler) == 2
  assert len({d.process_index for d in split.sampler}) == 1
  with pytest.raises(ValueError, match="splits a v5p-64 but the topology "
                     "is v5p-16"):
    check.place(config, topology.parse("v5p-16"))
  # v5e-8 split in halves: each compiles for a 2x2 topology of its own.
  config = smollm2.get_config()
  config.sampler.chips = "v5e-8:4-7"
  halves = check.place(config, topology.parse("v5e-8"))
  assert len(halves.trainer) == 4
  assert sorted(tuple(d.coords) for d in halves.trainer) == [
      (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]


def auto_attention_compiles_splash_for_tpu():
  """Ahead-of-time: the policy loss + gradients for a TPU, with 'auto'."""
  device = _tpu_device()
  cfg = ModelConfig.tiny(vocab_size=256, head_dim=64, dtype="bfloat16")
  b, t = 2, 384
  sharding = jax.sharding.SingleDeviceSharding(device)
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)
  model = tm.Transformer(cfg)
  tokens = jnp.ones((b, t), jnp.int32)
  params = jax.eval_shape(lambda: nn.unbox(model.init(
      jax.random.key(0), tokens, tm.positions_from_mask(tokens > 0),
      tokens > 0)))
  params = jax.tree.map(lambda x: sds(x.shape, x.dtype), params)

  def loss(p, tokens, positions, mask, seg):
    logits, _ = model.apply(p, tokens, positions, mask, segment_ids=seg)
    return jnp.mean(logits)

  with attention.lowering_for("tpu"):
    assert attention.choose(cfg, t, t, False) == "splash"
    lowered = jax.jit(jax.grad(loss)).lower(
        params, sds((b, t), jnp.int32), sds((b, t), jnp.int32),
        sds((b, t), jnp.bool_), sds((b, t), jnp.int32))
  text = lowered.compile().as_text()
  # Forward, dq and dkv kernels: once in the scanned layer body (each of
  # the 2 layers with scan_layers=False).
  layers = 1 if cfg.scan_layers else cfg.num_layers
  assert text.count("tpu_custom_call") >= 3 * layers, text[:2000]
