"""The sampler's device mesh: the policy and the KV cache over its chips.

``config.sampler.mesh`` lays the sampler process's devices (its whole block
of chips, docs/design/pods.md) out as the trainer's mesh axes
(`sharding.MESH_AXES`): ``data`` replicas (decode rows split between them),
``expert`` (the mesh's 'fsdp' axis, to which the trainer's rules give a MoE
layer's experts) and ``tensor`` (Megatron: heads, KV heads, MLP, vocab).
The trainer's logical-axis rules place the weights, with one change:
'embed' is kept whole (`sampler_rules`), so a decode step never gathers
weights, as FSDP would. The KV cache is split over KV heads on ``tensor``
(replicated where the heads are fewer than the chips, or MLA's one latent;
`sharding.logical_to_spec`) and over rows on ``data`` x ``expert``.

Prefill and decode (`decoding.py`) run jitted under `context()`: the
models' logical constraints take effect and each operation's state keeps
these shardings (`decoding.constrain_state`), so XLA inserts the
collectives and no step reshards the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
import ml_collections

from sao_jax import sharding
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import Transformer
from sao_jax.sampler import decoding

# sampler.mesh's fields, in `sharding.MESH_AXES` order.
FIELDS = ("data", "expert", "tensor")


def sampler_rules(rules: Any = None) -> sharding.Rules:
  """The trainer's rules (default `sharding.DEFAULT_RULES`) with 'embed'
  replicated: weights split over tensor and expert axes only."""
  return tuple((name, None if name == "embed" else axes)
               for name, axes in sharding.normalize_rules(rules))


def mesh_sizes(config: Any) -> tuple[int, int, int]:
  """``config.sampler.mesh`` as (data, expert, tensor) sizes, -1 filling
  the sampler's devices. ``tensor`` 0 (the default) is auto: the rest of
  the sampler's own block (-1) where ``sampler.chips`` gives it one, else 1
  (no split: the sampler shares the trainer's chips and takes the first);
  also 1 where ``data`` or ``expert`` already fills."""
  m = config.sampler.mesh
  sizes = [int(getattr(m, f)) for f in FIELDS]
  if sizes[2] == 0:
    split = bool(str(config.sampler.chips).strip())
    sizes[2] = -1 if split and -1 not in sizes[:2] else 1
  return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class SamplerMesh:
  """A mesh over the sampler's devices and the rules that place on it."""

  mesh: Mesh
  rules: sharding.Rules

  @classmethod
  def build(cls, sizes: Sequence[int], rules: Any = None,
            devices: Sequence[jax.Device] | None = None) -> "SamplerMesh":
    """Over the first data x expert x tensor of ``devices`` (default: this
    process's; a -1 size takes all of them)."""
    devices = list(jax.local_devices() if devices is None else devices)
    sizes = tuple(int(s) for s in sizes)
    if -1 not in sizes:
      need = sizes[0] * sizes[1] * sizes[2]
      if need > len(devices):
        raise sharding.MeshError(
            f"sampler.mesh (data, expert, tensor) = {sizes} needs {need} "
            f"devices; the sampler process has {len(devices)}. Lower the "
            "sizes or give the sampler more chips (sampler.chips).",
            "sampler.mesh", f"at most {len(devices)} devices", sizes)
      devices = devices[:need]
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(
        data=sizes[0], fsdp=sizes[1], tensor=sizes[2])), devices)
    return cls(mesh, sampler_rules(rules))

  @property
  def size(self) -> int:
    return self.mesh.size

  def context(self) -> contextlib.AbstractContextManager[None]:
    """Where the sampler's programs trace: mesh and rules in effect."""
    return sharding.mesh_rules(self.mesh, self.rules)

  def param_shardings(self, config: ModelConfig) -> Any:
    """`NamedSharding` per leaf of a `Transformer(config)`'s plain params."""
    tok = jnp.zeros((1, 1), jnp.int32)
    boxed = jax.eval_shape(lambda: Transformer(config).init(
        jax.random.PRNGKey(0), tok, tok, tok == 0))["params"]
    return sharding.param_shardings(boxed, self.mesh, self.rules)

  def state_shardings(self, state: decoding.DecodeState) -> Any:
    """`NamedSharding` per leaf of a (possibly abstract) `DecodeState`, by
    its logical axes (`decoding.state_axes`)."""
    return jax.tree.map(
        lambda names, a: NamedSharding(self.mesh, sharding.logical_to_spec(
            names, a.shape, self.mesh, self.rules, decoding.WARNED)),
        decoding.state_axes(state), state, is_leaf=decoding.is_names)


@contextlib.contextmanager
def maybe(mesh: SamplerMesh | None) -> Iterator[None]:
  """``mesh.context()``, or nothing without a mesh."""
  if mesh is None:
    yield
  else:
    with mesh.context():
      yield

