"""Device mesh, logical-axis sharding rules and multi-host helpers.

Parameters carry logical axis names (`nn.with_logical_partitioning`); the config
holds the logical -> mesh rules, so one config line moves a run between data
parallel, FSDP and tensor parallel (docs/design/overview.md "The shape"). The
mesh axes are always `('data', 'fsdp', 'tensor')`; unused axes have size 1.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Iterator, Mapping, Sequence

from absl import logging
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Batch over data x fsdp, weights' 'embed' over fsdp (ZeRO-3 style), and the
# Megatron split of vocab / MLP / heads over tensor.
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    # Expert parallelism over the FSDP axis: a MoE layer's [expert, ...]
    # weights are split expert-wise across it (layers/moe.py); before
    # 'embed', so the expert axis claims fsdp in those weights.
    ("expert", "fsdp"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    # MLA's low-rank bottlenecks (layers/mla.py): small, kept whole.
    ("q_lora", None),
    ("kv_lora", None),
    ("length", None),
    ("layers", None),  # The stacked layer axis (scan_layers): never split.
)


class MeshError(ValueError):
  """Mesh sizes or rules that do not fit the available devices.

  ``key``, ``expected`` and ``value`` name the offending config entry
  (``config_validation`` words its message from them).
  """

  def __init__(self, message: str, key: str = "mesh", expected: str = "",
               value: Any = None):
    super().__init__(message)
    self.key, self.expected, self.value = key, expected, value


def check_mesh_sizes(sizes: Sequence[int]) -> None:
  """Raises MeshError unless each size is positive or -1, with at most one -1."""
  sizes = tuple(int(s) for s in sizes)
  named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
  for axis, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise MeshError(
          f"mesh sizes must be positive or -1 (fill), got {named}.",
          f"mesh.{axis}", "a positive int or -1 (fill)", size)
  if sizes.count(-1) > 1:
    raise MeshError(
        f"at most one mesh size may be -1 (fill the remaining devices), got "
        f"{named}.", "mesh", "at most one of data/fsdp/tensor = -1",
        dict(zip(MESH_AXES, sizes)))


def resolve_mesh_shape(sizes: Sequence[int],
                       num_devices: int) -> tuple[int, ...]:
  """Replaces a single `-1` in `sizes` so that their product is `num_devices`.

  Raises:
    MeshError: sizes are not positive or -1, there is more than one -1, or they
      cannot multiply to `num_devices`.
  """
  check_mesh_sizes(sizes)
  sizes = tuple(int(s) for s in sizes)
  named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
  fixed = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % fixed:
      raise MeshError(
          f"mesh {named}: the fixed sizes multiply to {fixed}, which does not "
          f"divide the {num_devices} devices; change the sizes.")
    return tuple(num_devices // fixed if s == -1 else s for s in sizes)
  if fixed != num_devices:
    raise MeshError(
        f"mesh {named} needs {fixed} devices but {num_devices} are available; "
        "make the sizes multiply to the device count or set one to -1.")
  return sizes


def make_mesh(mesh_config: Any,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `('data', 'fsdp', 'tensor')` mesh over `devices` (default: all).

  Args:
    mesh_config: has integer fields `data`, `fsdp`, `tensor` (e.g. the
      `config.mesh` ConfigDict); one of them may be -1 to take the remaining
      devices.
    devices: devices to lay out; default `jax.devices()` (global, all hosts).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(
      [getattr(mesh_config, a) for a in MESH_AXES], len(devices))
  axis_types = (jax.sharding.AxisType.Auto,) * 3
  slices = len({getattr(d, "slice_index", 0) for d in devices})
  if slices > 1:  # Multi-slice: 'data' spans the slices (data-centre network).
    if shape[0] % slices:
      raise MeshError(
          f"mesh.data={shape[0]} must be a multiple of the {slices} slices: "
          "the data axis spans them; set mesh.data to it (or a multiple).",
          "mesh.data", f"a multiple of {slices}", shape[0])
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    grid = mesh_utils.create_hybrid_device_mesh(
        (shape[0] // slices, *shape[1:]), (slices, 1, 1), devices)
    mesh = Mesh(grid, MESH_AXES, axis_types=axis_types)
  else:
    try:
      mesh = jax.make_mesh(shape, MESH_AXES, axis_types=axis_types,
                           devices=devices)
    except AssertionError:  # Not a whole box of chips (a per-host block of
      # every host, sampler.chips): lay them out in their order.
      logging.warning("Devices %s are not a box of the slice; mesh in their "
                      "order.", [d.id for d in devices])
      mesh = Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES,
                  axis_types=axis_types)
  logging.info("Mesh %s over %d %s devices.", dict(mesh.shape), len(devices),
               devices[0].platform)
  return mesh


def normalize_rules(rules: Sequence[Sequence[Any]] | None) -> Rules:
  """Rules as hashable nested tuples (config overrides may give lists)."""
  if rules is None:
    return DEFAULT_RULES
  out = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise MeshError(
          f"sharding rule {rule!r} must be a (logical_name, mesh_axes) pair.")
    name, axes = rule
    if isinstance(axes, (list, tuple)):
      axes = tuple(axes)
      bad = [a for a in axes if a not in MESH_AXES]
    else:
      bad = [] if axes is None or axes in MESH_AXES else [axes]
    if bad:
      raise MeshError(
          f"sharding rule {rule!r} names mesh axes {bad}; the mesh axes are "
          f"{MESH_AXES} (or None to replicate).")
    out.append((name, axes))
  return tuple(out)


def logical_to_spec(names: Sequence[str | None], shape: Sequence[int],
                    mesh: Mesh, rules: Rules | None = None,
                    warned: set[str] | None = None) -> P:
  """PartitionSpec of an array from its logical axis names.

  Uses flax's priority rules (`nn.logical_to_mesh_axes`), then, for each
  dimension whose size is not divisible by the mesh axes assigned to it, drops
  trailing mesh axes until it is (down to replication) and logs a warning:
  tiny test models have sizes no mesh divides.
  """
  rules = normalize_rules(rules)
  spec = nn.logical_to_mesh_axes(tuple(names), rules)
  out = []
  for dim, (size, axes) in enumerate(zip(shape, spec)):
    if axes is None or axes is P.UNCONSTRAINED:
      out.append(axes)
      continue
    full = (axes,) if isinstance(axes, str) else tuple(axes)
    kept = full
    while kept and size % math.prod(mesh.shape[a] for a in kept):
      kept = kept[:-1]
    if kept != full:
      msg = (f"dim {dim} ({names[dim]!r}) of size {size} is not divisible by "
             f"mesh axes {full} of sizes {[mesh.shape[a] for a in full]}; "
             f"sharding it over {kept or 'nothing (replicated)'} instead.")
      if warned is None or msg not in warned:
        logging.warning("Array %s of shape %s: %s", tuple(names), tuple(shape),
                        msg)
        if warned is not None:
          warned.add(msg)
    if not kept:
      out.append(None)
    else:
      out.append(axes if kept == full else kept)
  return P(*out)


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.Partitioned)


def param_shardings(abstract_boxed: Any, mesh: Mesh,
                    rules: Rules | None = None) -> Any:
  """A pytree of `NamedSharding` for (abstract) boxed parameters.

  Args:
    abstract_boxed: e.g. `jax.eval_shape(model.init, ...)`: any pytree whose
      leaves are `nn.LogicallyPartitioned` boxes (sharded by `rules`) or plain
      arrays / ShapeDtypeStructs (replicated). Works for whole train states.
    mesh: from `make_mesh`.
    rules: logical -> mesh rules (default `DEFAULT_RULES`).

  Returns:
    The unboxed tree structure with a `NamedSharding` at every leaf.
  """
  rules = normalize_rules(rules)
  warned: set[str] = set()

  def one(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      spec = logical_to_spec(leaf.names, leaf.value.shape, mesh, rules, warned)
    elif isinstance(leaf, nn.Partitioned):  # Already mesh axes.
      spec = leaf.get_partition_spec()
    else:
      spec = P()
    return NamedSharding(mesh, spec)

  return jax.tree.map(one, abstract_boxed, is_leaf=_is_box)


def unbox(tree: Any) -> Any:
  """Strips `nn.Partitioned` boxes, leaving the raw arrays."""
  return nn.meta.unbox(tree)


def shard_params(params: Any, shardings: Any) -> Any:
  """Places (boxed or plain) host-replicated `params` on the mesh.

  Every process must pass the same values (same seed or checkpoint); each
  then keeps only the shards of its own devices.
  """
  def put(x, s):
    if s.is_fully_addressable:
      return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

  return jax.tree.map(put, unbox(params), shardings)


def batch_axes(rules: Rules | None = None) -> MeshAxes:
  """The mesh axes the rules give to the logical 'batch' axis."""
  for name, axes in normalize_rules(rules):
    if name == "batch":
      return axes
  return None


def batch_sharding(mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
  """Leading (batch) dimension split over the rules' 'batch' axes."""
  return NamedSharding(mesh, P(batch_axes(rules)))


def process_rows(x: Any) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in order.

  The rows it contributed (``stream.make_global_batch``), read from its own
  shards: no collective. A NumPy array is returned as it is.
  """
  if not isinstance(x, jax.Array):
    return np.asarray(x)
  shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}
  return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])


def to_host(tree: Any) -> Any:
  """NumPy copies of a pytree of (possibly multi-host) global arrays.

  Every process gets the whole value of every leaf: `jax.device_get` when
  this process can address all shards, else an all-gather over processes
  (`multihost_utils.process_allgather`), which every process must call at
  the same point (a collective).
  """
  leaves = jax.tree.leaves(tree)
  if all(not isinstance(x, jax.Array) or x.is_fully_addressable
         or x.is_fully_replicated for x in leaves):
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


@contextlib.contextmanager
def mesh_rules(mesh: Mesh, rules: Rules | None = None) -> Iterator[None]:
  """Context in which the models' `nn.with_logical_constraint` take effect."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(normalize_rules(rules)):
    yield


def _get(config: Any, key: str, default: Any = None) -> Any:
  if isinstance(config, Mapping):
    return config.get(key, default)
  return getattr(config, key, default)


def initialize_distributed(config: Any) -> bool:
  """Joins a multi-process JAX job (`jax.distributed.initialize`).

  Settings come from `config` (the `config.distributed` section:
  `coordinator_address`, `num_processes`, `process_id`, optional
  `local_device_ids`, `cpu_collectives`, `auto_detect`), each falling back to
  the environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
  `JAX_PROCESS_ID`. With `auto_detect` JAX finds the cluster itself (TPU pods,
  SLURM, ...). With one process and no coordinator this is a no-op.

  Must run before anything touches a JAX device.

  Returns:
    Whether `jax.distributed.initialize` was called.
  """
  if _get(config, "auto_detect", False):
    jax.distributed.initialize()
    logging.info("Distributed (auto-detected): process %d of %d.",
                 jax.process_index(), jax.process_count())
    return True
  address = _get(config, "coordinator_address") or os.environ.get(
      "JAX_COORDINATOR_ADDRESS") or None
  num = _get(config, "num_processes")
  if num is None and os.environ.get("JAX_NUM_PROCESSES"):
    num = int(os.environ["JAX_NUM_PROCESSES"])
  pid = _get(config, "process_id")
  if pid is None and os.environ.get("JAX_PROCESS_ID"):
    pid = int(os.environ["JAX_PROCESS_ID"])
  if (num is None or num <= 1) and address is None:
    logging.info("Single process run; not initialising jax.distributed.")
    return False
  missing = [n for n, v in (("coordinator_address", address),
                            ("num_processes", num), ("process_id", pid))
             if v is None]
  if missing:
    raise ValueError(
        f"multi-process run needs distributed.{', '.join(missing)} (config or "
        "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID).")
  if not 0 <= pid < num:
    raise ValueError(
        f"distributed.process_id={pid} must be in [0, num_processes={num}).")
  collectives = _get(config, "cpu_collectives")
  if collectives:
    jax.config.update("jax_cpu_collectives_implementation", collectives)
  local_ids = _get(config, "local_device_ids")
  jax.distributed.initialize(
      coordinator_address=address, num_processes=int(num),
      process_id=int(pid),
      local_device_ids=list(local_ids) if local_ids else None)
  logging.info("Distributed: process %d of %d, coordinator %s.",
               jax.process_index(), jax.process_count(), address)
  return True


def agreed(flag: bool) -> bool:
  """Process 0's ``flag`` on every host (a decision that hosts' clocks would
  otherwise split; every host must take the same steps)."""
  if jax.process_count() == 1:
    return flag
  return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))
