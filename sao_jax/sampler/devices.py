"""Accelerator chips of their own for the sampler process (docs/design/pods.md
"Processes and chips").

``config.sampler.chips`` splits a host's accelerators between the trainer and
the sampler process:

- ``''``: no split (the sampler shares the trainer's devices, as on one GPU;
  ``sampler.devices`` may still pin it to CPU cores).
- ``'gpu:IDS'`` (``'gpu:1'``, ``'gpu:2,3'``, ``'gpu:4-7'``): the sampler sees
  those GPUs, the trainer the others (``CUDA_VISIBLE_DEVICES``; ids index the
  GPUs the job itself was given).
- ``'SLICE:IDS'`` (``'v5e-8:4-7'``, ``'v6e-16:4-7'``, ``'v5p-16:2,3'``): on
  each host of that TPU slice the sampler takes chips IDS and the trainer the
  rest. A TPU VM's chips open in one process unless libtpu is told which are
  whose, so each process gets libtpu's per-process variables
  (``TPU_VISIBLE_CHIPS`` and its older name ``TPU_VISIBLE_DEVICES``,
  ``TPU_CHIPS_PER_PROCESS_BOUNDS``, ``TPU_PROCESS_BOUNDS``, its own
  ``TPU_PROCESS_PORT`` / ``TPU_MESH_CONTROLLER_PORT``,
  ``ALLOW_MULTIPLE_LIBTPU_LOAD``). Both parts must be blocks of the host's chip
  grid with 1, 2, 4 or 8 chips (``check_split``), so each is itself a
  topology libtpu can run and the AOT command can compile for.

``process_env(config, role)`` is the environment a process gets; ``apply``
sets it, and must run before the process initialises its JAX backend (the
trainer: ``main`` before ``jax.distributed``; the sampler: first thing in the
spawned child).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

from absl import logging

from sao_jax import tpu_topology as topo_lib

ROLES = ("trainer", "sampler")
# Distinct per process on a host: libtpu's process and mesh-controller ports.
_PROCESS_PORT = {"trainer": 8476, "sampler": 8477}
_CONTROLLER_PORT = {"trainer": 8478, "sampler": 8479}
_BLOCK_CHIPS = (1, 2, 4, 8)


class ChipsError(ValueError):
  """``sampler.chips`` is malformed or not a valid split of the host."""


@dataclasses.dataclass(frozen=True)
class ChipSplit:
  """A parsed ``sampler.chips``.

  Attributes:
    kind: 'gpu' or 'tpu'.
    sampler: the sampler's GPU ids / chip ids on each host.
    topology: the TPU slice (None on GPU).
  """

  kind: str
  sampler: tuple[int, ...]
  topology: topo_lib.Topology | None = None

  def trainer_chips(self) -> tuple[int, ...]:
    """The trainer's chip ids on each host (TPU)."""
    return tuple(c for c in range(self.topology.chips_per_host)
                 if c not in self.sampler)

  def blocks(self) -> dict[str, tuple[int, int, int]]:
    """Each role's chip block on a host: {'trainer': (x, y, z), ...}."""
    grid = self.topology.host_shape
    return {"trainer": topo_lib.block_shape(self.trainer_chips(), grid),
            "sampler": topo_lib.block_shape(self.sampler, grid)}


def _parse_ids(text: str, spec: str) -> tuple[int, ...]:
  ids: list[int] = []
  for part in filter(None, text.split(",")):
    lo, _, hi = part.partition("-")
    try:
      ids.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
      raise ChipsError(
          f"sampler.chips={spec!r}: expected ids such as '1', '2,3' or "
          "'4-7' after the colon.") from None
  if not ids or len(set(ids)) != len(ids) or min(ids) < 0:
    raise ChipsError(f"sampler.chips={spec!r}: the ids must be distinct "
                     "non-negative integers, at least one.")
  return tuple(ids)


def parse_chips(spec: str) -> ChipSplit | None:
  """``sampler.chips`` as a ``ChipSplit`` (None for ''); checks TPU splits."""
  spec = str(spec).strip()
  if not spec:
    return None
  head, sep, ids = spec.rpartition(":")
  if not sep or not head:
    raise ChipsError(
        f"sampler.chips={spec!r}: expected 'gpu:IDS' or 'SLICE:IDS' (e.g. "
        "'gpu:1', 'v5e-8:4-7'), or '' for no split.")
  chips = _parse_ids(ids, spec)
  if head.lower() == "gpu":
    return ChipSplit("gpu", chips)
  try:
    topology = topo_lib.parse(head)
  except topo_lib.TopologyError as e:
    raise ChipsError(f"sampler.chips={spec!r}: {e}") from None
  split = ChipSplit("tpu", chips, topology)
  check_split(split, spec)
  return split


def check_split(split: ChipSplit, spec: str = "") -> None:
  """Raises ``ChipsError`` unless the sampler's and the trainer's chips are
  each a block of the host's chip grid of 1, 2, 4 or 8 chips."""
  topo = split.topology
  grid, per_host = topo.host_shape, topo.chips_per_host
  where = (f"sampler.chips={spec!r}: on a {topo.name} host (chips 0-"
           f"{per_host - 1}, grid {'x'.join(map(str, grid))})")
  if max(split.sampler) >= per_host:
    raise ChipsError(f"{where} there is no chip {max(split.sampler)}.")
  if len(split.sampler) == per_host:
    raise ChipsError(f"{where} the sampler would take every chip; leave the "
                     "trainer some.")
  for role, block in split.blocks().items():
    chips = split.sampler if role == "sampler" else split.trainer_chips()
    if block is None or len(chips) not in _BLOCK_CHIPS:
      raise ChipsError(
          f"{where} the {role}'s chips {list(chips)} are not a block of 1, "
          "2, 4 or 8 neighbouring chips; choose ids so both parts are, e.g. "
          f"{_example(topo)}.")


def _example(topo: topo_lib.Topology) -> str:
  half = topo.chips_per_host // 2
  return f"'{topo.name}:{half}-{topo.chips_per_host - 1}'"


def _bounds(shape: Sequence[int]) -> str:
  return ",".join(str(int(s)) for s in shape)


def tpu_env(split: ChipSplit, role: str,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
  """libtpu's per-process variables for ``role`` on each host of the slice.

  The sampler is one process per host (not part of the distributed job);
  the trainers of a multi-host slice are one process per host over their
  chips of every host, addressed through ``TPU_WORKER_HOSTNAMES`` (set on
  Cloud TPU VMs; comma-separated).
  """
  topo = split.topology
  chips = split.sampler if role == "sampler" else split.trainer_chips()
  ids = ",".join(map(str, chips))
  port = _PROCESS_PORT[role]
  env = {
      "TPU_VISIBLE_CHIPS": ids,
      "TPU_VISIBLE_DEVICES": ids,  # The older name of TPU_VISIBLE_CHIPS.
      "TPU_CHIPS_PER_PROCESS_BOUNDS": _bounds(split.blocks()[role]),
      "TPU_PROCESS_BOUNDS": "1,1,1",
      "TPU_PROCESS_PORT": str(port),
      "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
      "TPU_MESH_CONTROLLER_PORT": str(_CONTROLLER_PORT[role]),
      "TPU_MESH_CONTROLLER_ADDRESS": f"localhost:{_CONTROLLER_PORT[role]}",
      "ALLOW_MULTIPLE_LIBTPU_LOAD": "true",
  }
  if role == "trainer" and topo.num_hosts > 1:
    environ = os.environ if environ is None else environ
    hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
             if h]
    if len(hosts) != topo.num_hosts:
      raise ChipsError(
          f"sampler.chips on {topo.name} ({topo.num_hosts} hosts): the "
          f"trainer needs TPU_WORKER_HOSTNAMES naming the {topo.num_hosts} "
          f"hosts (got {len(hosts)}); set it to their comma-separated "
          "addresses in TPU_WORKER_ID order.")
    env["TPU_PROCESS_BOUNDS"] = _bounds(topo.host_bounds)
    env["TPU_PROCESS_ADDRESSES"] = ",".join(f"{h}:{port}" for h in hosts)
    del env["TPU_MESH_CONTROLLER_ADDRESS"]  # Host 0's, found by libtpu.
  return env


def _gpu_ids(environ: Mapping[str, str]) -> list[str]:
  """The GPUs this job was given: CUDA_VISIBLE_DEVICES, else all found."""
  visible = environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return [v for v in visible.split(",") if v.strip()]
  proc = "/proc/driver/nvidia/gpus"
  count = len(os.listdir(proc)) if os.path.isdir(proc) else 0
  return [str(i) for i in range(count)]


def gpu_env(split: ChipSplit, role: str,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
  """``CUDA_VISIBLE_DEVICES`` for ``role``: the sampler its ids, the trainer
  the rest of the job's GPUs."""
  gpus = _gpu_ids(os.environ if environ is None else environ)
  if max(split.sampler) >= len(gpus) or len(split.sampler) >= len(gpus):
    raise ChipsError(
        f"sampler.chips='gpu:{','.join(map(str, split.sampler))}' needs GPU "
        f"ids below {len(gpus)} leaving the trainer at least one; this job "
        f"has {len(gpus)} GPUs ({','.join(gpus) or 'none'}).")
  mine = [g for i, g in enumerate(gpus)
          if (i in split.sampler) == (role == "sampler")]
  return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def process_env(chips: str, role: str,
                environ: Mapping[str, str] | None = None) -> dict[str, str]:
  """The variables ``role`` ('trainer' or 'sampler') gets for ``sampler.chips``
  (empty with no split)."""
  if role not in ROLES:
    raise ValueError(f"role {role!r}: expected one of {ROLES}.")
  split = parse_chips(chips)
  if split is None:
    return {}
  return (gpu_env if split.kind == "gpu" else tpu_env)(split, role, environ)


def _backend_initialized() -> bool:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.backends_are_initialized()


def apply(chips: str, role: str) -> dict[str, str]:
  """Sets ``process_env`` in ``os.environ``; returns what it set.

  Raises:
    RuntimeError: this process's JAX backend is already initialised (the
      variables would have no effect).
  """
  env = process_env(chips, role)
  if not env:
    return env
  if _backend_initialized():
    raise RuntimeError(
        f"sampler.chips={chips!r}: the {role}'s JAX backend is already "
        "initialised, so its chips can no longer be chosen; apply the split "
        "before anything touches a device.")
  os.environ.update(env)
  logging.info("%s process devices: %s", role, env)
  return env

