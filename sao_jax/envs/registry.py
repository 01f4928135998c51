"""Environments by name (configs pick environments by string).

An entry is an `Environment` class: `build.make_envs` makes its instances with
`from_config(config.env, tasks)`, the class reading its own settings from
the section (`Environment.config_kwargs`). Adding an environment is its class
and one entry here (or a `register_env` call).
"""

from __future__ import annotations

from typing import Any

from sao_jax import registry as registry_lib
from sao_jax.envs.base import Environment
from sao_jax.envs.code_env import CodeEnv
from sao_jax.envs.evolving import EvolvingEnv
from sao_jax.envs.longtail import LongTailToolEnv
from sao_jax.envs.reasoning_gym_env import ReasoningGymEnv
from sao_jax.envs.repair_env import RepairEnv
from sao_jax.envs.tool_env import ToolEnv

EnvFactory = type[Environment]
_REGISTRY = registry_lib.Registry[EnvFactory]("environment", {
    "reasoning_gym": ReasoningGymEnv,
    "tool": ToolEnv,
    "evolving": EvolvingEnv,
    "tool_longtail": LongTailToolEnv,
    "code": CodeEnv,  # Sandboxed Python (envs/code_env.py).
    "repair": RepairEnv,  # Repository repair (envs/repair_env.py).
}, how="register_env (docs/design/extending.md)")


def register_env(name: str, factory: EnvFactory) -> None:
  """Adds `factory` under `name`; refuses to silently replace one."""
  _REGISTRY.register(name, factory)


def available_envs() -> tuple[str, ...]:
  """Registered environment names, sorted."""
  return _REGISTRY.names()


def get_env(name: str) -> EnvFactory:
  """The class registered under `name`; raises (a KeyError) listing the
  registered ones."""
  return _REGISTRY.get(name)


def make_env(name: str, *args: Any, **kwargs: Any) -> Environment:
  """A new environment instance, e.g. make_env('tool', tasks, max_tool_calls=2)."""
  return get_env(name)(*args, **kwargs)
