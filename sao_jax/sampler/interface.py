"""One `Rollout` interface for every engine that runs episodes.

The sampler host process and the held-out evaluation drive episodes through
`Rollout` only: ``start``, ``run`` (episodes from an `EpisodeFeed`, multi-
turn with the environment's observations and tool calls, until told to
stop), ``update_weights`` (in flight or between episodes) and ``stop``. Each
engine has one episode loop; the rules of an episode (``rollout.Episode``)
and the admission, numbering and writing of episodes (``feed.EpisodeFeed``)
are shared, so the sampler's promises (exactly once, staleness, routing
records, the ring's MAC) do not depend on the engine.

Engines (``sampler.engine``; ``factory.make_rollout`` builds them):

* ``'native'`` (``engine.NativeRollout``): our JAX decoder (``generate.py``),
  slots of a per-row KV cache, on every backend. The default.
* ``'vllm'`` (``vllm_engine.VllmRollout``): vLLM's ``AsyncLLM``, continuous
  batching and prefix caching; needs the ``vllm`` extra (README "Rollout
  engines").

Every trajectory carries, per action token, the log-prob the engine sampled
it with (under ``sampler.temperature``, ``top_k``, ``top_p``) and the
weights version that sampled it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from sao_jax import ranges
from sao_jax import sharding
from sao_jax.data.trajectory import Trajectory
from sao_jax.sampler import feed as feed_lib
from sao_jax.sampler import mesh as mesh_lib
from sao_jax.sampler import rollout
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.sampler.stats import SamplerStats

KV_ON_SWAP = ("keep", "recompute")
# The allowed value of each `EngineOptions` field (`ranges`); config_validation
# checks sampler.<field> with them (num_slots there may be 0: batch_size).
FIELD_RULES = {
    **{k: ranges.POSITIVE for k in (
        "num_slots", "decode_chunk", "env_threads", "n_rollouts")},
    "weight_poll_tokens": ranges.NONNEG,
    "prefill_rows": ranges.NONNEG,
    "kv_on_swap": ranges.one_of(KV_ON_SWAP),
}

# () -> (params, version): the newest published weights (None, None before
# the first publication). In the sampler process: the weight slot.
WeightSource = Callable[[], tuple[Any, int | None]]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """How episodes run in flight (``config.sampler``; ``engine.py``)."""

  num_slots: int = 8
  decode_chunk: int = 16
  weight_poll_tokens: int = 32
  refill: bool = True
  kv_on_swap: str = "keep"
  env_threads: int = 4
  n_rollouts: int = 1
  row_subsets: bool = True
  # The native engine's device mesh (``sampler.mesh``: data, expert, tensor
  # sizes; `sampler/mesh.py`) and the trainer's logical-axis rules (None:
  # the defaults); mesh None: no mesh (the weights stay where they are).
  mesh: tuple[int, int, int] | None = None
  mesh_rules: Any = None
  # The most rows one prefill / append call feeds (`generate.Generator`);
  # 0: no limit.
  prefill_rows: int = 0

  def __post_init__(self):
    ranges.check_fields(self, FIELD_RULES)
    if self.num_slots % self.n_rollouts:
      raise ValueError(
          f"sampler.num_slots={self.num_slots} is not a multiple of "
          f"sampler.n_rollouts={self.n_rollouts}.")

  @classmethod
  def from_config(cls, config: Any) -> "EngineOptions":
    s = config.sampler
    return cls(num_slots=rollout.num_slots(config),
               decode_chunk=int(s.decode_chunk),
               weight_poll_tokens=int(s.weight_poll_tokens),
               refill=bool(s.refill), kv_on_swap=str(s.kv_on_swap),
               env_threads=int(s.env_threads), n_rollouts=int(s.n_rollouts),
               row_subsets=bool(s.row_subsets),
               mesh=mesh_lib.mesh_sizes(config),
               mesh_rules=sharding.normalize_rules(config.mesh.rules),
               prefill_rows=int(s.prefill_rows))


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """What any engine needs to know to run episodes (not the model)."""

  options: EngineOptions = EngineOptions()
  limits: rollout.RolloutLimits = rollout.RolloutLimits()
  sampling: SamplingParams = SamplingParams()
  stop_ids: tuple[int, ...] | None = None  # None: the tokenizer's.

  @classmethod
  def from_config(cls, config: Any) -> "RolloutSettings":
    s = config.sampler
    return cls(EngineOptions.from_config(config),
               rollout.RolloutLimits.from_config(config),
               SamplingParams(temperature=float(s.temperature),
                              top_p=float(s.top_p), top_k=int(s.top_k)))


@runtime_checkable
class Rollout(Protocol):
  """An engine that runs episodes (module docstring)."""

  name: str  # ``sampler.engine``.
  # The weights version in use (None before the first weights).
  version: int | None

  def start(self) -> None:
    """Acquires the engine (model, processes); idempotent."""

  def stop(self) -> None:
    """Releases it; episodes in flight are abandoned (``run`` counted them)."""

  def update_weights(self, params: Any, version: int) -> None:
    """Adopts ``params`` as ``version`` now: episodes in flight go on with
    them (their cache kept or recomputed, ``sampler.kv_on_swap``); each
    token records the version that sampled it."""

  def run(self, feed: feed_lib.EpisodeFeed,
          should_stop: Callable[[], bool]) -> int:
    """Runs ``feed``'s episodes until ``should_stop()`` (or, for a feed
    with a ``limit``, until all are written); newer weights from the
    engine's `WeightSource` are adopted as ``sampler.weight_poll_tokens``
    says. Returns the number of episodes abandoned in flight."""


def run_episodes(engine: Rollout, tasks: Sequence[Any],
                 stats=None) -> list[Trajectory]:
  """One episode per task through ``engine``; the trajectories in task order
  (their ``group_id`` is the task's index). Evaluation's entry point."""
  out: list[Trajectory] = []

  def outbox(trajs: list[Trajectory]) -> bool:
    out.extend(trajs)
    trajs.clear()
    return True

  feed = feed_lib.EpisodeFeed.for_tasks(
      tasks, outbox, SamplerStats() if stats is None else stats)
  engine.run(feed, lambda: len(out) >= len(tasks))
  return sorted(out, key=lambda t: t.group_id)
