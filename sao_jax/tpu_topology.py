"""TPU slice names, their chip grids, hosts and HBM (docs/design/pods.md
"Checking before renting").

Cloud TPU names a slice ``v5e-8``, ``v6e-16``, ``v5p-64``, ``v4-32``: the
number is chips for v5e/v6e and TensorCores for v4/v5p (two per chip,
"megacore"), so a v5p-64 has 32 chips. libtpu's compile-only topologies are
named by their chip grid instead (``v5e:2x4``, ``v5:2x4x4``); ``parse`` maps
one onto the other and ``compile_devices`` asks libtpu for the devices of a
slice (or of a block of its chips), which a machine without TPUs can compile
for. Everything but ``compile_devices`` is pure and needs no libtpu.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Sequence

_GIB = 2**30
# Compiling needs no TPU; these keep libtpu from probing for one, and let
# several processes (tests, a sampler) load it at once.
LIBTPU_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "true", "TPU_SKIP_MDS_QUERY": "true"}


@dataclasses.dataclass(frozen=True)
class Family:
  """A TPU generation: how its slices are named and what one chip has."""

  prefix: str  # libtpu's topology prefix ('v5e', 'v5' for v5p, ...).
  cores_per_chip: int  # Cores counted in the slice name per chip.
  hbm_bytes: int  # HBM per chip.
  host: tuple[int, int, int]  # Chip grid of one host (of a multi-host slice).
  shapes: dict[int, tuple[int, int, int]]  # Chips -> chip grid.
  megacore: bool
  # One chip's HBM bandwidth and bfloat16 peak (the roofline of
  # aot/sampler_sizing.py): Google Cloud's TPU v4 / v5e / v5p / v6e system
  # architecture pages, as of 2026.
  hbm_bytes_per_s: float = 0.0
  peak_bf16_flops: float = 0.0


_2D = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1), 16: (4, 4, 1),
       32: (4, 8, 1), 64: (8, 8, 1), 128: (8, 16, 1), 256: (16, 16, 1)}
_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4),
       64: (4, 4, 4), 128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8),
       1024: (8, 8, 16), 2048: (8, 16, 16)}

FAMILIES: dict[str, Family] = {
    "v4": Family("v4", 2, 32 * _GIB, (2, 2, 1), _3D, True,
                 hbm_bytes_per_s=1.2e12, peak_bf16_flops=275e12),
    "v5p": Family("v5", 2, 95 * _GIB, (2, 2, 1), _3D, True,
                  hbm_bytes_per_s=2.765e12, peak_bf16_flops=459e12),
    "v5e": Family("v5e", 1, 16 * _GIB, (2, 4, 1), _2D, False,
                  hbm_bytes_per_s=0.819e12, peak_bf16_flops=197e12),
    "v6e": Family("v6e", 1, 32 * _GIB, (2, 4, 1), _2D, False,
                  hbm_bytes_per_s=1.64e12, peak_bf16_flops=918e12),
}


class TopologyError(ValueError):
  """A slice name or chip block that does not exist."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """One slice: its family, chip grid and host grid."""

  name: str  # As Cloud TPU names it, e.g. 'v5e-8'.
  family: str
  shape: tuple[int, int, int]  # Chips along x, y, z.

  @property
  def spec(self) -> Family:
    return FAMILIES[self.family]

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def host_shape(self) -> tuple[int, int, int]:
    """One host's chip grid (the whole slice when it is one host)."""
    return tuple(min(h, s) for h, s in zip(self.spec.host, self.shape))

  @property
  def chips_per_host(self) -> int:
    return math.prod(self.host_shape)

  @property
  def num_hosts(self) -> int:
    return self.chips // self.chips_per_host

  @property
  def host_bounds(self) -> tuple[int, int, int]:
    """Hosts along x, y, z (libtpu's ``TPU_PROCESS_BOUNDS`` for one process
    per host)."""
    return tuple(s // h for s, h in zip(self.shape, self.host_shape))

  @property
  def hbm_bytes(self) -> int:
    return self.spec.hbm_bytes


def grid_name(family: str, shape: Sequence[int]) -> str:
  """libtpu's name of a chip grid: 'v5e:2x4', 'v5:2x2x1' (v5p)."""
  fam = FAMILIES[family]
  dims = tuple(shape) if fam.megacore else tuple(shape)[:2]
  return f"{fam.prefix}:{'x'.join(str(int(d)) for d in dims)}"


def parse(name: str) -> Topology:
  """``Topology`` of a Cloud TPU slice name ('v5e-8', 'v5p-64', 'v4-16')."""
  match = re.fullmatch(r"(v4|v5p|v5e|v6e)-(\d+)", name.strip().lower())
  if not match:
    raise TopologyError(
        f"unknown TPU slice {name!r}: expected <family>-<N> with family one "
        f"of {', '.join(FAMILIES)} (e.g. v5e-8, v6e-16, v5p-64, v4-32).")
  family, n = match.group(1), int(match.group(2))
  fam = FAMILIES[family]
  if n % fam.cores_per_chip or n // fam.cores_per_chip not in fam.shapes:
    sizes = ", ".join(f"{family}-{c * fam.cores_per_chip}"
                      for c in sorted(fam.shapes))
    raise TopologyError(f"no slice {name!r}; known {family} slices: {sizes}.")
  return Topology(f"{family}-{n}", family,
                  fam.shapes[n // fam.cores_per_chip])


def chip_coords(chip: int, grid: Sequence[int]) -> tuple[int, int, int]:
  """(x, y, z) of chip id ``chip`` in a grid (x fastest, as libtpu numbers)."""
  gx, gy, _ = grid
  return chip % gx, (chip // gx) % gy, chip // (gx * gy)


def block_shape(chips: Sequence[int], grid: Sequence[int]
                ) -> tuple[int, int, int] | None:
  """The (x, y, z) extent of ``chips`` if they fill an axis-aligned block of
  ``grid`` exactly, else None."""
  if not chips or len(set(chips)) != len(chips):
    return None
  if any(c < 0 or c >= math.prod(grid) for c in chips):
    return None
  coords = [chip_coords(c, grid) for c in chips]
  lo = [min(c[i] for c in coords) for i in range(3)]
  hi = [max(c[i] for c in coords) for i in range(3)]
  extent = tuple(h - l + 1 for l, h in zip(lo, hi))
  return extent if math.prod(extent) == len(chips) else None


def _set_libtpu_env() -> None:
  for key, value in LIBTPU_ENV.items():
    os.environ.setdefault(key, value)


def libtpu_available() -> tuple[bool, str]:
  """(whether libtpu can make compile-only devices here, why not)."""
  _set_libtpu_env()
  try:
    import libtpu  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False, ("libtpu is not installed (pip install -e '.[tpu]', "
                   "jax[tpu] at this project's jax version).")
  try:
    compile_devices("v5e", (2, 2, 1))
  except Exception as e:  # pylint: disable=broad-except
    return False, f"libtpu did not load: {str(e).splitlines()[0]}"
  return True, ""


def compile_devices(family: str, shape: Sequence[int], *,
                    host: Sequence[int] | None = None,
                    num_slices: int = 1) -> list[Any]:
  """Compile-only devices of a chip grid (``jax.experimental.topologies``).

  Args:
    family: a ``FAMILIES`` key.
    shape: the chip grid (x, y, z).
    host: one host's chip grid (default: the family's, capped by ``shape``).
    num_slices: slices joined over the data-centre network (multi-slice).
  """
  _set_libtpu_env()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  fam = FAMILIES[family]
  host = tuple(host) if host is not None else tuple(
      min(h, s) for h, s in zip(fam.host, shape))
  kwargs: dict[str, Any] = {"chips_per_host_bounds": host,
                            "wrap": (False, False, False)}
  if fam.megacore:
    kwargs["chip_config_name"] = "megacore"
  if num_slices > 1:
    kwargs["num_slices"] = int(num_slices)
  return list(topologies.get_topology_desc(
      topology_name=grid_name(family, shape), platform="tpu",
      **kwargs).devices)


def local_chip(device: Any, topo: Topology) -> int:
  """A compile-only device's chip id on its own host (``TPU_VISIBLE_CHIPS``
  numbering)."""
  hx, hy, hz = topo.host_shape
  x, y, z = (int(c) for c in device.coords)
  return (x % hx) + hx * ((y % hy) + hy * (z % hz))
