"""A table of named entries, the one way extension points are registered.

Losses (``rl/registry.py``), advantage estimators (``rl/advantages.py``),
environments (``envs/registry.py``) and model families
(``models/families/registry.py``) each keep a ``Registry``: configs pick an
entry by name, and a new one is one ``register`` call
(docs/design/extending.md).
"""

from __future__ import annotations

from typing import Generic, Iterator, Mapping, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
  """A name no entry is registered under (a KeyError and a ValueError, so
  either kind of handler catches it); its text is the message itself."""

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
  """Name -> entry; a taken name is refused, an unknown one named with the
  known ones and how to add one.

  Attributes:
    kind: What an entry is, e.g. 'loss', in error messages.
    plural: The plural of ``kind``.
    how: How to add one, e.g. 'register_loss (docs/design/extending.md)'.
  """

  def __init__(self, kind: str, entries: Mapping[str, T] | None = None, *,
               how: str, plural: str | None = None):
    self.kind = kind
    self.plural = plural or f"{kind}s"
    self.how = how
    self._entries: dict[str, T] = {}
    for name, entry in (entries or {}).items():
      self.register(name, entry)

  def register(self, name: str, entry: T) -> T:
    """Adds ``entry`` under ``name``; refuses to replace one."""
    if name in self._entries:
      raise ValueError(
          f"{self.kind[:1].upper()}{self.kind[1:]} {name!r} is already "
          "registered.")
    self._entries[name] = entry
    return entry

  def get(self, name: str) -> T:
    """The entry under ``name``; raises naming the known ones if none."""
    try:
      return self._entries[name]
    except KeyError:
      raise UnknownNameError(
          f"Unknown {self.kind} {name!r}; known {self.plural}: "
          f"{', '.join(self.names())}. A new one is registered with "
          f"{self.how}.") from None

  def names(self) -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(self._entries))

  def values(self) -> tuple[T, ...]:
    """The entries, in registration order."""
    return tuple(self._entries.values())

  def copy(self) -> "Registry[T]":
    """A registry of the same entries that registers apart from this one."""
    new = Registry(self.kind, how=self.how, plural=self.plural)
    new._entries = dict(self._entries)  # pylint: disable=protected-access
    return new

  def __contains__(self, name: object) -> bool:
    return name in self._entries

  def __iter__(self) -> Iterator[str]:
    """The names, in registration order."""
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)
