"""The sampler's copy of the policy in sampler.param_dtype (issue 43 item 3):
the dtype it resolves to, the cast the trainer publishes through, the weight
slot it fills and the AOT sizes that follow. A run whose sampler generates
from bfloat16 weights is tests/train/test_loop.py's async metrics run."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import base
from sao_jax import config_validation
from sao_jax import sharding
from sao_jax.aot import programs
from sao_jax.ipc import weights as weights_lib
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import precision
from sao_jax.train import publish as publish_lib

_TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)


def _config(**sampler):
  config = base.get_config()
  config.sampler.update(sampler)
  return config


@pytest.mark.parametrize("model_dtype,setting,want", [
    ("float32", "", "float32"), ("bfloat16", "", "bfloat16"),
    ("bfloat16", "float32", "float32"), ("float32", "bfloat16", "bfloat16"),
    ("float32", "float16", "float16")])
def test_the_sampler_dtype_follows_the_compute_dtype_unless_set(
    model_dtype, setting, want):
  mcfg = ModelConfig(**{**_TINY.__dict__, "dtype": model_dtype,
                        "param_dtype": "float32"})
  got = precision.sampler_model_config(_config(param_dtype=setting), mcfg)
  assert got.param_dtype == want
  assert got.dtype == model_dtype  # Only the storage dtype changes.
  assert got.num_params() == mcfg.num_params()


def test_an_unknown_dtype_is_refused_with_the_choices():
  config = _config(param_dtype="bf16")
  with pytest.raises(config_validation.ConfigError) as e:
    config_validation.validate_config(config)
  assert str(e.value) == (
      "config.sampler.param_dtype: expected '' (model.dtype) or one of "
      "('', 'float32', 'bfloat16', 'float16'), got 'bf16'")
  with pytest.raises(ValueError, match="got 'bf16'"):
    precision.param_dtype(config, _TINY)


def test_the_cast_keeps_sharding_and_integer_leaves():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  everywhere = jax.sharding.NamedSharding(mesh,
                                          jax.sharding.PartitionSpec())
  w = jax.device_put(jnp.linspace(-3.0, 3.0, 8 * 4).reshape(8, 4), shard)
  params = {"w": w, "count": jax.device_put(jnp.arange(4, dtype=jnp.int32),
                                            everywhere),
            "half": jax.device_put(jnp.ones(3, jnp.float16), everywhere)}
  cast = precision.caster("bfloat16")(params)
  assert cast["w"].dtype == jnp.bfloat16 and cast["w"].sharding == shard
  assert cast["half"].dtype == jnp.bfloat16
  assert cast["count"].dtype == jnp.int32
  np.testing.assert_array_equal(cast["count"], params["count"])
  np.testing.assert_array_equal(
      np.asarray(cast["w"]), np.asarray(w).astype(ml_dtypes.bfloat16))
  same = {"w": w.astype(jnp.bfloat16), "count": params["count"]}
  assert precision.caster("bfloat16")(same) is same  # Nothing to cast.


def test_the_publisher_fills_a_slot_of_half_the_bytes():
  # Leaves of whole 64-byte lines in both dtypes (the slot aligns each).
  params = {"w": jnp.linspace(-1.0, 1.0, 64).reshape(16, 4),
            "b": jnp.full((32,), 1 / 3)}
  cast = precision.caster("bfloat16")
  f32 = weights_lib.WeightSlot.create(sharding.to_host(params))
  slot = weights_lib.WeightSlot.create(sharding.to_host(cast(params)))
  try:
    assert slot.nbytes * 2 == f32.nbytes
    publisher = publish_lib.Publisher(slot, lag=0, cast=cast)
    publisher(params, 1)
    version, got = slot.read(timeout=1.0)
    assert version == 1
    for name in ("w", "b"):
      assert got[name].dtype == ml_dtypes.bfloat16
      np.testing.assert_array_equal(
          got[name], np.asarray(params[name]).astype(ml_dtypes.bfloat16))
    assert got["b"][0] != np.float32(1 / 3)  # Really rounded.
  finally:
    slot.close()
    f32.close()


def test_aot_sizes_the_slot_in_the_sampler_dtype():
  f32 = precision.sampler_model_config(_config(param_dtype="float32"), _TINY)
  bf16 = precision.sampler_model_config(_config(param_dtype="bfloat16"),
                                        _TINY)
  header = weights_lib.slot_bytes({})
  full, half = (programs.weight_slot_bytes(m) - header for m in (f32, bf16))
  assert 2 * 4 * _TINY.num_params() <= full  # Two float32 buffers.
  assert half * 2 == pytest.approx(full, rel=0.02)  # Leaf alignment aside.
