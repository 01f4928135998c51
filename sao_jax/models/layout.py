"""Converts parameter trees between the stacked and per-layer layouts.

`ModelConfig.scan_layers=True` keeps every decoder layer's parameters in one
`layers` subtree, each leaf with a leading [L] axis (logical name 'layers');
`scan_layers=False` keeps `layers_0` ... `layers_{L-1}` (docs/design/models.md
"Layer layout"). These functions map any pytree holding such subtrees (params,
optimizer moments, a whole train state, abstract `ShapeDtypeStruct` trees
with shardings, logically boxed params) from one layout to the other: used to
restore checkpoints of the other layout and to compare the two model paths.
"""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sao_jax.models.config import LAYERS_AXIS

STACKED = "layers"
_PER_LAYER = re.compile(r"^layers_(\d+)$")


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.LogicallyPartitioned)


def _per_layer_keys(node: dict) -> list[str]:
  return [k for k in node if isinstance(k, str) and _PER_LAYER.match(k)]


def _holds_layers(x: Any) -> bool:
  return isinstance(x, dict) and (STACKED in x or bool(_per_layer_keys(x)))


def layouts(tree: Any) -> set[str]:
  """The layouts found in `tree`: a subset of {'stacked', 'per_layer'}."""
  found = set()
  for node in jax.tree.leaves(tree, is_leaf=_holds_layers):
    if isinstance(node, dict):
      found.add("stacked" if STACKED in node else "per_layer")
  return found


def _slice(leaf: Any, i: int) -> Any:
  """Layer i of one stacked leaf (array, ShapeDtypeStruct or box)."""
  if _is_box(leaf):
    names = tuple(leaf.names)
    return leaf.replace(value=_slice(leaf.value, i), names=names[1:])
  if isinstance(leaf, jax.ShapeDtypeStruct):
    sharding = leaf.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
  if hasattr(leaf, "shape") and leaf.ndim:
    return leaf[i]
  return leaf  # Not an array (e.g. an optax.MaskedNode): kept as it is.


def _stack(leaves: list[Any]) -> Any:
  """One stacked leaf from the per-layer leaves (arrays, structs or boxes)."""
  first = leaves[0]
  if _is_box(first):
    return first.replace(value=_stack([b.value for b in leaves]),
                         names=(LAYERS_AXIS, *first.names))
  if isinstance(first, jax.ShapeDtypeStruct):
    sharding = first.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype,
                                sharding=sharding)
  if hasattr(first, "shape"):
    return jnp.stack(leaves)
  return first


def unstack_layers(tree: Any) -> Any:
  """`tree` with every stacked `layers` subtree split into `layers_{i}`."""
  def one(node):
    if not (isinstance(node, dict) and STACKED in node):
      return node
    leaves = jax.tree.leaves(node[STACKED], is_leaf=_is_box)
    sized = [x for x in leaves if getattr(x, "ndim", 0) or _is_box(x)]
    if not sized:
      raise ValueError("a stacked `layers` subtree holds no arrays.")
    first = sized[0].value if _is_box(sized[0]) else sized[0]
    out = {k: v for k, v in node.items() if k != STACKED}
    for i in range(first.shape[0]):
      out[f"layers_{i}"] = jax.tree.map(lambda x, i=i: _slice(x, i),
                                        node[STACKED], is_leaf=_is_box)
    return out

  return jax.tree.map(one, tree, is_leaf=_holds_layers)


def stack_layers(tree: Any) -> Any:
  """`tree` with every run of `layers_0..layers_{L-1}` stacked into `layers`.

  Raises:
    ValueError: the per-layer keys are not 0..L-1, or the layers differ in
      structure.
  """
  def one(node):
    if not isinstance(node, dict):
      return node
    keys = _per_layer_keys(node)
    if not keys:
      return node
    n = len(keys)
    if sorted(int(_PER_LAYER.match(k).group(1)) for k in keys) != list(
        range(n)):
      raise ValueError(f"per-layer keys {sorted(keys)} are not layers_0.."
                       f"layers_{n - 1}.")
    layers = [node[f"layers_{i}"] for i in range(n)]
    out = {k: v for k, v in node.items() if k not in keys}
    out[STACKED] = jax.tree.map(lambda *xs: _stack(list(xs)), *layers,
                                is_leaf=_is_box)
    return out

  return jax.tree.map(one, tree, is_leaf=_holds_layers)


def to_layout(tree: Any, scan_layers: bool) -> Any:
  """`tree` in the layout of `ModelConfig.scan_layers` (a no-op if it is)."""
  return stack_layers(tree) if scan_layers else unstack_layers(tree)
