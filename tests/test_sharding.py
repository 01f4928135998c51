"""Tests for sao_jax.sharding.

Unit tests of the mesh arithmetic and logical rules run in-process (specs only
need the mesh shape: `AbstractMesh`). The acceptance test runs this file as a
subprocess with 8 fake CPU devices (XLA_FLAGS must be set before JAX starts) and
checks that a (2, 2, 2)-sharded forward+backward of the policy and the value
model equals the single-device one.
"""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from sao_jax import sharding
from sao_jax.data import stream as stream_lib
import multihost

_MESH = AbstractMesh((2, 2, 2), sharding.MESH_AXES)


@pytest.mark.parametrize("sizes,n,want", [
    ((2, 2, 2), 8, (2, 2, 2)),
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((1, -1, 2), 8, (1, 4, 2)),
    ((2, 1, -1), 2, (2, 1, 1)),
    ((1, 1, -1), 1, (1, 1, 1)),
])
def test_resolve_mesh_shape(sizes, n, want):
  assert sharding.resolve_mesh_shape(sizes, n) == want


@pytest.mark.parametrize("sizes,n,match", [
    ((2, 2, 1), 8, "needs 4 devices but 8 are available"),
    ((3, -1, 1), 8, "does not divide the 8 devices"),
    ((-1, -1, 1), 8, "at most one mesh size may be -1"),
    ((0, 1, 1), 1, "must be positive or -1"),
    ((-2, 1, 1), 1, "must be positive or -1"),
])
def test_resolve_mesh_shape_errors(sizes, n, match):
  with pytest.raises(sharding.MeshError, match=match):
    sharding.resolve_mesh_shape(sizes, n)


def test_make_mesh_fills_local_devices():
  cfg = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=1))
  mesh = sharding.make_mesh(cfg)
  assert mesh.axis_names == sharding.MESH_AXES
  assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(),
                              "tensor": 1}
  with pytest.raises(sharding.MeshError, match="needs 64 devices"):
    sharding.make_mesh(ml_collections.ConfigDict(
        dict(data=8, fsdp=8, tensor=1)))


def test_default_rules_specs():
  spec = lambda names, shape: sharding.logical_to_spec(names, shape, _MESH)
  assert spec(("vocab", "embed"), (128, 64)) == P("tensor", "fsdp")
  assert spec(("embed", "mlp"), (64, 128)) == P("fsdp", "tensor")
  assert spec(("embed", "heads", "head_dim"), (64, 4, 16)) == P(
      "fsdp", "tensor", None)
  assert spec(("heads", "head_dim", "embed"), (4, 16, 64)) == P(
      "tensor", None, "fsdp")
  assert spec(("embed",), (64,)) == P("fsdp")
  assert spec(("embed", None), (64, 1)) == P("fsdp", None)
  # Activations: batch over data x fsdp; 'embed' then loses fsdp (used).
  assert spec(("batch", "length", "embed"), (8, 16, 64)) == P(
      ("data", "fsdp"), None, None)


def test_non_divisible_dims_fall_back(caplog):
  spec = lambda names, shape: sharding.logical_to_spec(names, shape, _MESH)
  with caplog.at_level("WARNING"):
    assert spec(("vocab", "embed"), (131, 64)) == P(None, "fsdp")
  assert "size 131 is not divisible" in caplog.text
  # Batch 6 cannot split 4 ways but can split over 'data' (2).
  assert spec(("batch", "length"), (6, 3)) == P(("data",), None)
  assert spec(("batch", "length"), (3, 3)) == P(None, None)
  # One kv head cannot be split over tensor=2.
  assert spec(("embed", "kv_heads", "head_dim"), (64, 1, 16)) == P(
      "fsdp", None, None)


def test_rules_from_config_switch_parallelism():
  fsdp_only = (("embed", "fsdp"), ("mlp", None), ("batch", ("data", "fsdp")))
  assert sharding.logical_to_spec(("embed", "mlp"), (64, 128), _MESH,
                                  fsdp_only) == P("fsdp", None)
  # Lists (as config overrides produce) are accepted.
  tp = [["mlp", "tensor"], ["embed", None]]
  assert sharding.logical_to_spec(("embed", "mlp"), (64, 128), _MESH,
                                  tp) == P(None, "tensor")
  with pytest.raises(sharding.MeshError, match=r"names mesh axes \['model'\]"):
    sharding.normalize_rules((("mlp", "model"),))
  with pytest.raises(sharding.MeshError, match="must be a"):
    sharding.normalize_rules((("mlp",),))


def test_param_shardings_on_boxed_tree():
  mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  leaf = jax.ShapeDtypeStruct((64, 128), np.float32)
  tree = {"w": nn.LogicallyPartitioned(leaf, ("embed", "mlp")),
          "step": jax.ShapeDtypeStruct((), np.int32)}
  out = sharding.param_shardings(tree, mesh)
  assert set(out) == {"w", "step"}
  assert out["w"].spec == P("fsdp", "tensor")
  assert out["step"].spec == P()
  params = {"w": nn.LogicallyPartitioned(np.ones((64, 128), np.float32),
                                         ("embed", "mlp")),
            "step": np.int32(3)}
  placed = sharding.shard_params(params, out)
  assert isinstance(placed["w"], jax.Array)
  assert placed["w"].sharding == out["w"]
  np.testing.assert_array_equal(placed["w"], np.ones((64, 128)))
  assert int(placed["step"]) == 3


def test_batch_sharding_and_global_batch():
  mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * 3)
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp"))
  assert sharding.batch_axes((("batch", "data"),)) == "data"
  local = {"tokens": np.arange(12, dtype=np.int32).reshape(4, 3)}
  glob = stream_lib.make_global_batch(local, sharding.batch_sharding(mesh))
  assert glob["tokens"].shape == (4, 3)
  np.testing.assert_array_equal(glob["tokens"], local["tokens"])
  np.testing.assert_array_equal(sharding.process_rows(glob["tokens"]),
                                local["tokens"])


def test_initialize_distributed_single_process_is_noop(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
              "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  cfg = ml_collections.ConfigDict(dict(
      coordinator_address=None, num_processes=1, process_id=0))
  assert sharding.initialize_distributed(cfg) is False
  bad = ml_collections.ConfigDict(dict(
      coordinator_address="localhost:1234", num_processes=2, process_id=2))
  with pytest.raises(ValueError, match="process_id=2 must be in"):
    sharding.initialize_distributed(bad)
  missing = dict(coordinator_address=None, num_processes=2, process_id=None)
  with pytest.raises(ValueError, match="coordinator_address, process_id"):
    sharding.initialize_distributed(missing)


# --------------------------------------------------------------------------
# Acceptance: (2, 2, 2) mesh over 8 fake CPU devices == one device. The
# subprocesses run this file's `__main__`.


def _policy_loss(model, params, batch):
  """Masked next-token NLL."""
  logits, _ = model.apply({"params": params}, batch["tokens"],
                          batch["positions"], batch["mask"])
  logp = jax.nn.log_softmax(logits[:, :-1])
  tgt = batch["tokens"][:, 1:]
  tok_logp = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
  w = (batch["mask"][:, 1:] & batch["mask"][:, :-1]).astype(np.float32)
  return -(tok_logp * w).sum() / w.sum()


def _value_loss(model, params, batch):
  """Masked MSE to random targets."""
  values = model.apply({"params": params}, batch["tokens"],
                       batch["positions"], batch["mask"])
  w = batch["mask"].astype(np.float32)
  return (((values - batch["targets"]) ** 2) * w).sum() / w.sum()


def _first_leaf(tree, key: str):
  """The first leaf whose path contains `key` (layer naming is the model's)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if key in jax.tree_util.keystr(path):
      return leaf
  raise KeyError(f"no parameter path contains {key!r}")


def _problem():
  """Tiny model config and an [8, 16] left-padded batch (same on all hosts)."""
  from sao_jax.models import config as model_config
  from sao_jax.models import transformer

  cfg = model_config.ModelConfig(
      vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16)
  b, t = 8, 16
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  lengths = rng.integers(t // 2, t + 1, (b,))
  mask = np.arange(t)[None, :] >= (t - lengths)[:, None]
  batch = dict(tokens=tokens, mask=mask,
               positions=np.asarray(transformer.positions_from_mask(mask)),
               targets=rng.normal(size=(b, t)).astype(np.float32))
  models = (("policy", transformer.Transformer(cfg), _policy_loss),
            ("value", transformer.ValueModel(cfg), _value_loss))
  return cfg, batch, models


def _compare(mesh, batch, local_batch, models) -> dict:
  """Sharded vs one-device loss and gradients of each model."""
  import functools

  from jax.experimental import multihost_utils

  rules = sharding.DEFAULT_RULES
  out = {}
  for name, model, loss_fn in models:
    init = functools.partial(model.init, jax.random.key(1), batch["tokens"],
                             batch["positions"], batch["mask"])
    boxed = jax.eval_shape(init)["params"]
    shardings = sharding.param_shardings(boxed, mesh, rules)
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, model))

    # Reference: everything on one local device.
    dev0 = jax.local_devices()[0]
    params = jax.device_put(sharding.unbox(jax.jit(init)()["params"]), dev0)
    ref_loss, ref_grads = jax.jit(grad_fn)(params, jax.device_put(batch, dev0))

    with sharding.mesh_rules(mesh, rules):
      sharded_params = sharding.shard_params(params, shardings)
      # Params created straight into their shards (jit with out_shardings).
      direct = jax.jit(lambda: sharding.unbox(init()["params"]),
                       out_shardings=shardings)()
      sharded_batch = stream_lib.make_global_batch(
          local_batch, sharding.batch_sharding(mesh, rules))
      # This process's rows come back without a collective.
      np.testing.assert_array_equal(
          sharding.process_rows(sharded_batch["tokens"]),
          local_batch["tokens"])
      step = jax.jit(
          grad_fn,
          in_shardings=(shardings, sharding.batch_sharding(mesh, rules)),
          out_shardings=(sharding.NamedSharding(mesh, P()), shardings))
      loss, grads = step(sharded_params, sharded_batch)

    full_grads = multihost_utils.process_allgather(grads, tiled=True)
    init_diff = jax.tree.map(
        lambda a, r: float(np.max(np.abs(np.asarray(a) - np.asarray(r)))),
        multihost_utils.process_allgather(direct, tiled=True), params)
    diffs = jax.tree.map(lambda a, r: float(np.max(np.abs(
        np.asarray(a) - np.asarray(r)))), full_grads, ref_grads)
    gate, ggate = _first_leaf(sharded_params, "gate_proj"), _first_leaf(
        grads, "gate_proj")
    out[name] = dict(
        loss=float(loss), ref_loss=float(ref_loss),
        max_grad_diff=max(jax.tree.leaves(diffs)),
        max_init_diff=max(jax.tree.leaves(init_diff)),
        init_spec_equal=all(jax.tree.leaves(jax.tree.map(
            lambda a, s: a.sharding == s, direct, shardings))),
        max_grad_abs=max(float(np.max(np.abs(np.asarray(g))))
                         for g in jax.tree.leaves(ref_grads)),
        gate_spec=[str(a) for a in gate.sharding.spec],
        gate_shard_shapes=sorted({tuple(s.data.shape)
                                  for s in gate.addressable_shards}),
        gate_num_shards=len(gate.addressable_shards),
        gate_grad_spec=[str(a) for a in ggate.sharding.spec],
        batch_shape=list(sharded_batch["tokens"].shape),
        batch_shard_shapes=sorted({tuple(s.data.shape) for s in
                                   sharded_batch["tokens"].addressable_shards}),
        num_params=sum(int(np.size(p)) for p in jax.tree.leaves(params)),
    )
  return out


def _single_process_main() -> dict:
  """8 local devices; the whole batch is this process's."""
  assert jax.device_count() == 8, jax.devices()
  cfg, batch, models = _problem()
  mesh = sharding.make_mesh(ml_collections.ConfigDict(
      dict(data=2, fsdp=2, tensor=2)))
  out = _compare(mesh, batch, batch, models)
  out["expected_num_params"] = cfg.num_params()
  return out


def _multi_process_main(process_id: int, port: int) -> dict:
  """2 processes x 4 devices; each process feeds half of the batch rows."""
  sharding.initialize_distributed(ml_collections.ConfigDict(dict(
      coordinator_address=f"localhost:{port}", num_processes=2,
      process_id=process_id, cpu_collectives="gloo")))
  _, batch, models = _problem()
  mesh = sharding.make_mesh(ml_collections.ConfigDict(
      dict(data=2, fsdp=2, tensor=2)))
  rows = slice(4 * process_id, 4 * process_id + 4)
  local = {k: v[rows] for k, v in batch.items()}
  # The policy only: the value model shares the backbone (tested above).
  out = _compare(mesh, batch, local, models[:1])
  out["process"] = [jax.process_index(), jax.process_count(),
                    jax.device_count(), jax.local_device_count()]
  return out


def _run_self(*args, devices: int) -> subprocess.Popen:
  return multihost.run_as_main(__file__, *args, devices=devices,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)


def _result(proc, timeout=600) -> dict:
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0, stderr[-4000:]
  return json.loads(stdout.strip().splitlines()[-1])


def _check_equal_to_single_device(r: dict) -> None:
  assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, r
  assert r["max_grad_diff"] <= 1e-5, r
  # Initialising straight into shards gives the same parameters.
  assert r["max_init_diff"] == 0.0 and r["init_spec_equal"], r
  assert r["max_grad_abs"] > 1e-4  # Gradients are not trivially zero.
  # Stacked [layers=2, embed=64, mlp=128]: the layer axis never split,
  # embed x mlp split fsdp x tensor: 8 shards of [2, 32, 64].
  assert r["gate_spec"] == ["None", "fsdp", "tensor"]
  assert r["gate_shard_shapes"] == [[2, 32, 64]]
  assert r["gate_grad_spec"] == ["None", "fsdp", "tensor"]
  # Global batch 8 over data x fsdp = 4: rows of 2 (replicated over tensor).
  assert r["batch_shape"] == [8, 16]
  assert r["batch_shard_shapes"] == [[2, 16]]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sharded_forward_backward_matches_single_device():
  res = _result(_run_self("single", devices=8))
  pol, val = res["policy"], res["value"]
  assert pol["num_params"] == res["expected_num_params"]
  for r in (pol, val):
    _check_equal_to_single_device(r)
    assert r["gate_num_shards"] == 8
  # A policy NLL on random tokens near log(vocab); MSE to N(0,1) near 1.
  assert abs(pol["ref_loss"] - np.log(128)) < 0.5
  assert 0.3 < val["ref_loss"] < 3.0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_gloo_match_single_device():
  port = multihost.free_port()
  procs = [_run_self("multi", i, port, devices=4) for i in range(2)]
  try:
    results = [_result(p) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, res in enumerate(results):
    assert res["process"] == [i, 2, 8, 4]
    _check_equal_to_single_device(res["policy"])
    assert res["policy"]["gate_num_shards"] == 4  # This host's 4 devices.
  # Both hosts saw the same global loss.
  assert results[0]["policy"]["loss"] == results[1]["policy"]["loss"]


if __name__ == "__main__":
  if sys.argv[1] == "single":
    print(json.dumps(_single_process_main()))
  else:
    print(json.dumps(_multi_process_main(int(sys.argv[2]), int(sys.argv[3]))))
