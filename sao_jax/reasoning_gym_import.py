"""reasoning-gym, imported for the datasets a process uses.

reasoning-gym's ``__init__`` imports all 13 of its dataset subpackages (sympy
alone, for the algebra, geometry and games ones, 0.4 s) and cellpylib (its
Game of Life datasets, with matplotlib.pyplot): about 0.7 s in every trainer,
sampler and evaluation process, against ~0.1 s for the arithmetic datasets.
`import_reasoning_gym(datasets)` imports reasoning-gym's factory and the
subpackages that register ``datasets`` only (found in its sources,
`dataset_subpackages`); ``create_dataset`` and ``get_score_answer_fn`` of that
package import the subpackage of any other name they are given, and any
other attribute it lacks runs reasoning-gym's own ``__init__``. A leaf
module: `envs` and `tokenization` both use it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pathlib
import re
import sys
import types
from typing import Any, Iterable

# Modules reasoning-gym imports at its own import time that only a few of its
# datasets use: cellpylib (its two Game of Life datasets, by attribute only)
# imports matplotlib.pyplot, 0.57 of reasoning_gym's 1.19 s import.
_LOADED_ON_FIRST_USE = ("cellpylib",)
_PACKAGE = "reasoning_gym"
# How a dataset module names itself (every registered dataset, checked
# against reasoning-gym's registry by tests/envs/test_envs.py).
_DATASET_NAME = re.compile(r"""^DATASET_NAME\s*=\s*["'](\w+)["']""", re.M)
_REGISTERED = re.compile(r"""register_dataset\(\s*["'](\w+)["']""")


class _OnFirstUse(types.ModuleType):
  """A module that imports the real one at its first attribute lookup.

  (The standard library's ``importlib.util.LazyLoader`` loads at the import
  system's own ``__spec__`` check, so a second ``import`` of it is eager.)
  """

  def __getattr__(self, attr: str) -> Any:  # Only attributes not yet set.
    name = self.__name__
    if sys.modules.get(name) is self:
      del sys.modules[name]
    real = importlib.import_module(name)
    self.__dict__.update(real.__dict__)
    return getattr(real, attr)


def package_dir() -> pathlib.Path | None:
  """Where reasoning-gym is installed (None: it is not), found without
  importing it."""
  spec = importlib.util.find_spec(_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    return None
  return pathlib.Path(spec.submodule_search_locations[0])


@functools.cache
def dataset_subpackages() -> dict[str, str | None]:
  """reasoning-gym's dataset names -> the subpackage whose import registers
  them (``reasoning_gym.arithmetic`` ...; None: a top-level module's, such as
  composite, which builds the others), read from its sources, unimported."""
  root = package_dir()
  if root is None:
    return {}
  out = {}
  for path in sorted(root.rglob("*.py")):
    text = path.read_text(encoding="utf-8")
    if "register_dataset(" not in text or path.name == "factory.py":
      continue
    top = path.relative_to(root).parts[0]
    for name in _DATASET_NAME.findall(text) + _REGISTERED.findall(text):
      out[name] = None if top.endswith(".py") else f"{_PACKAGE}.{top}"
  return out


def _complete(package: types.ModuleType) -> types.ModuleType:
  """Runs reasoning-gym's own ``__init__`` in a partly imported package
  (every subpackage, its version, ``__all__``)."""
  if package.__dict__.pop("_sao_partial", False):
    del package.__getattr__
    package.__spec__.loader.exec_module(package)
  return package


def _partial_package() -> types.ModuleType:
  """``reasoning_gym`` with its factory but no dataset subpackage: its
  ``__init__`` (which imports all of them) not run. Any attribute it lacks
  runs it; ``create_dataset`` and ``get_score_answer_fn`` import the
  subpackage of the name they are given first."""
  spec = importlib.util.find_spec(_PACKAGE)
  package = importlib.util.module_from_spec(spec)
  package._sao_partial = True  # pylint: disable=protected-access
  sys.modules[_PACKAGE] = package
  # Its own order: coaching (which imports the factory through composite)
  # before the factory (which imports coaching's curriculum).
  importlib.import_module(f"{_PACKAGE}.coaching")
  factory = importlib.import_module(f"{_PACKAGE}.factory")

  def needing(fn):
    @functools.wraps(fn)
    def call(name, *args, **kwargs):
      _load(package, (name,))
      return fn(name, *args, **kwargs)
    return call

  package.create_dataset = needing(factory.create_dataset)
  package.get_score_answer_fn = needing(factory.get_score_answer_fn)
  package.register_dataset = factory.register_dataset
  package.__getattr__ = lambda attr: getattr(_complete(package), attr)
  return package


def _load(package: types.ModuleType, datasets: Iterable[str]) -> None:
  """Imports the subpackages registering ``datasets``; the whole package for
  a name no subpackage registers (composite, a typo: the registry's error)."""
  where = dataset_subpackages()
  for name in datasets:
    if where.get(name) is None:
      _complete(package)
      return
    importlib.import_module(where[name])


def import_reasoning_gym(datasets: Iterable[str] | None = None
                         ) -> types.ModuleType:
  """``reasoning_gym`` (the module docstring): whole, or with ``datasets``
  only the subpackages that register them. A module of
  ``_LOADED_ON_FIRST_USE`` is imported at its first attribute lookup (the
  datasets that use it work as before; the others never pay for it)."""
  for name in _LOADED_ON_FIRST_USE:
    if name not in sys.modules and importlib.util.find_spec(name) is not None:
      sys.modules[name] = _OnFirstUse(name)
  package = sys.modules.get(_PACKAGE)
  if datasets is None:
    if package is None:
      import reasoning_gym as package  # pylint: disable=g-import-not-at-top
    return _complete(package)
  if package is None:
    package = _partial_package()
  _load(package, datasets)
  return package
