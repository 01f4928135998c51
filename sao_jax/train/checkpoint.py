"""Orbax checkpoints of the whole training state plus JSON metadata.

One checkpoint holds: the array state (``TrainState``: policy and value params,
both optimizer states, the step and policy-version counters, the running-mean
table) as an orbax ``StandardSave`` item, and a JSON item with what else a
resume needs: ``episodes_consumed`` (how many trajectories all hosts read),
``episodes`` (per host, which episode numbers it read: a watermark and the
set above it, ``data/consumed.py``; the resumed sampler starts at the
watermark and skips the set, so no episode is consumed twice or never; a
checkpoint without it resumes at ``episodes_consumed / process_count``), the
stream's counters and the held-out accuracy before RL.
No RNG key is saved: the sampler derives each batch's key from the seed and
the batch index. Saves are atomic (orbax writes to a temporary
directory and renames), so a trainer killed mid-save leaves the previous
checkpoint as the newest complete one. A state with a NaN/Inf leaf is never
saved (the previous checkpoints stay the newest). A checkpoint written in the
other layer layout (per-layer ``layers_{i}`` vs stacked ``layers``,
``model.scan_layers``; docs/design/models.md "Layer layout") is restored in its
own layout and converted to the state's (``models/layout.py``).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from sao_jax.models import layout
from sao_jax.train import health

_STATE = "state"
_META = "meta"


class CheckpointError(RuntimeError):
  """A checkpoint directory is missing, malformed or does not fit the state."""


class Checkpointer:
  """Thin wrapper over ``ocp.CheckpointManager`` with one state and one meta item."""

  def __init__(self, directory: str, *, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True,
        enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=(_STATE, _META))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
    """Saves ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``.

    Returns:
      False (and saves nothing) if a floating-point leaf of ``state`` is not
      finite, so that rotation never deletes a good checkpoint for a bad one.
    """
    bad = health.nonfinite_leaves(state)
    if bad:
      logging.error(
          "Not saving checkpoint step %d: %d leaves hold NaN/Inf (first: %s); "
          "the newest checkpoint in %s stays step %s.", step, len(bad),
          bad[0], self.directory, self.latest_step())
      return False
    self._manager.save(
        step,
        args=ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(state),
            _META: ocp.args.JsonSave(meta),
        }),
        force=True)
    self._manager.wait_until_finished()
    logging.info("Saved checkpoint step %d to %s", step, self.directory)
    return True

  def restore(self, abstract_state: Any,
              step: int | None = None) -> tuple[Any, dict[str, Any], int]:
    """Restores ``(state, meta, step)``; ``step=None`` means the newest.

    Args:
      abstract_state: A pytree of ``jax.ShapeDtypeStruct`` (with shardings) or
        arrays giving the target structure, shapes, dtypes and placement.
      step: Which step to restore.

    Raises:
      CheckpointError: No checkpoint exists, or it does not match the state.
    """
    if step is None:
      step = self.latest_step()
    if step is None:
      raise CheckpointError(
          f"No checkpoint found in {self.directory}; start a fresh run or point "
          "--workdir at a run that has saved one.")
    abstract_state = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    saved = self._saved_layout(step)
    wanted = layout.layouts(abstract_state)
    convert = bool(saved and wanted and saved != wanted)
    if convert and (len(saved) > 1 or len(wanted) > 1):
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} holds layer layouts "
          f"{sorted(saved)}, the state {sorted(wanted)}: cannot convert a "
          "mixed layout; restore it with the model.scan_layers it was written "
          "with.")
    target = (layout.to_layout(abstract_state, "stacked" in saved)
              if convert else abstract_state)
    try:
      restored = self._manager.restore(
          step,
          args=ocp.args.Composite(**{
              _STATE: ocp.args.StandardRestore(target),
              _META: ocp.args.JsonRestore(),
          }))
    except Exception as e:  # Orbax raises many types; name the directory.
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} could not be restored "
          f"({type(e).__name__}: {e}). It is malformed or was written by a run "
          "with a different model/optimizer config; delete it or use the "
          "matching config.") from e
    state = restored[_STATE]
    if convert:
      state = self._convert(state, abstract_state, step, saved, wanted)
    return state, dict(restored[_META]), step

  def _saved_layout(self, step: int) -> set[str]:
    """The layer layouts of the state saved at ``step`` (empty if unknown)."""
    try:
      meta = self._manager.item_metadata(step)[_STATE]
    except Exception:  # pylint: disable=broad-except
      return set()  # No metadata: the restore below reports what is wrong.
    return layout.layouts(getattr(meta, "tree", meta))

  def _convert(self, state: Any, abstract_state: Any, step: int,
               saved: set[str], wanted: set[str]) -> Any:
    """``state`` (restored in layout ``saved``) in the layout ``wanted``."""
    logging.warning(
        "Checkpoint step %d in %s has the %s layer layout, the run the %s one "
        "(model.scan_layers): converting it on restore; the next save is in "
        "the run's layout.", step, self.directory, saved.pop(), wanted.pop())
    state = layout.to_layout(state, "stacked" in layout.layouts(
        abstract_state))

    def place(x, target):
      sharding = getattr(target, "sharding", None)
      return x if sharding is None else jax.device_put(x, sharding)

    return jax.tree.map(place, state, abstract_state)

  def restore_newest(self, abstract_state: Any
                     ) -> tuple[Any, dict[str, Any], int]:
    """Restores the newest checkpoint that restores, newest first.

    A checkpoint that fails is skipped with a warning naming it and, in a
    one-process run, renamed ``<step>.unrestorable`` (kept for inspection,
    out of the rotation).

    Raises:
      CheckpointError: none exists, or none restores (the newest one's error).
    """
    first_error = None
    for step in reversed(self.all_steps()):
      try:
        return self.restore(abstract_state, step)
      except CheckpointError as e:
        first_error = first_error or e
        logging.warning("Skipping checkpoint step %d: %s", step, e)
        if jax.process_count() == 1:  # Hosts of one run share the directory.
          bad = os.path.join(self.directory, str(step))
          os.replace(bad, bad + ".unrestorable")
          logging.warning("Moved it to %s.", bad + ".unrestorable")
          self._manager.reload()
    if first_error is not None:
      raise first_error
    return self.restore(abstract_state)  # Raises: no checkpoint.

  def close(self) -> None:
    self._manager.close()
