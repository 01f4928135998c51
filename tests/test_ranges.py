"""Tests for sao_jax.ranges: each setting's range defined once, by the code
that uses it, and applied by the config check."""

import re

import pytest

from sao_jax import config_validation as cv
from sao_jax import ranges
from sao_jax.models import config as model_config
from sao_jax.sampler import interface
from sao_jax.sampler import sampling
from sao_jax.sandbox import limits
from sao_jax.sandbox import pool
from sao_jax.sandbox import probe
from sao_jax.train import optim


def _refused(config, message: str) -> None:
  """validate_config refuses `config` with exactly `message`."""
  with pytest.raises(cv.ConfigError, match=f"^{re.escape(message)}$"):
    cv.validate_config(config)


def test_rule_names_the_field_and_what_it_expects():
  rule = ranges.Rule(lambda v: v > 2, "int > 2")
  rule.check("n", 3)
  with pytest.raises(ranges.RangeError) as info:
    rule.check("n", 1)
  assert str(info.value) == "n=1: expected int > 2."
  assert (info.value.field, info.value.expected, info.value.value) == (
      "n", "int > 2", 1)
  assert not ranges.POSITIVE.ok(True) and not ranges.POSITIVE.ok(0)
  assert ranges.POSITIVE.ok(1)


def test_dataclasses_check_their_fields_with_their_rules():
  with pytest.raises(ranges.RangeError, match=r"^hidden_size=0: expected a "
                     r"positive int\.$"):
    model_config.ModelConfig.tiny(hidden_size=0)
  with pytest.raises(ranges.RangeError, match="^kv_on_swap='drop'"):
    interface.EngineOptions(kv_on_swap="drop")
  with pytest.raises(ranges.RangeError, match="^wall_s=inf: expected a finite"):
    limits.Limits(wall_s=float("inf"))
  sampling.SamplingParams(temperature=0.0, greedy=True)  # Greedy: any.
  with pytest.raises(ranges.RangeError, match="^temperature=0.0"):
    sampling.SamplingParams(temperature=0.0)


# A key -> the rule the module that uses its setting defines for it.
_OWNER_RULES = {
    "model.attention": model_config.FIELD_RULES["attention"],
    "model.hidden_size": model_config.FIELD_RULES["hidden_size"],
    "sampler.kv_on_swap": interface.FIELD_RULES["kv_on_swap"],
    "sampler.top_p": sampling.FIELD_RULES["top_p"],
    "env.code_wall_s": limits.FIELD_RULES["wall_s"],
    "env.code_sandbox": ranges.one_of(probe.MECHANISMS),
    "env.code_mode": ranges.one_of(pool.MODES),
    "optim.schedule": ranges.one_of(optim.SCHEDULES),
}


@pytest.mark.parametrize("path,bad", [
    ("model.attention", "flash"), ("model.hidden_size", -8),
    ("sampler.kv_on_swap", "drop"), ("sampler.top_p", 1.5),
    ("env.code_wall_s", float("inf")), ("env.code_sandbox", "docker"),
    ("env.code_mode", "lukewarm"), ("optim.schedule", "linear")])
def test_ranges_come_from_the_code_that_uses_them(path, bad):
  """The config check words a key's range as the owning module's rule does,
  and that rule refuses the value."""
  rule = _OWNER_RULES[path]
  assert not rule.ok(bad)
  config = cv.base_config()
  section, key = path.split(".")
  config[section][key] = bad
  _refused(config, f"config.{path}: expected {rule.expected}, got {bad!r}")


def test_model_section_is_checked_as_model_config():
  """ModelConfig's rules across fields refuse the config before start-up."""
  config = cv.base_config()
  config.model.moe.num_experts = 4
  config.model.moe.top_k = 8
  config.model.moe.intermediate_size = 64
  _refused(config, "config.model: MoE top_k=8 must be in [1, num_experts=4].")
  config.model.moe.top_k = 2
  cv.validate_config(config)
  config.model.rotary_dim = 4
  config.model.head_dim = 2
  _refused(config, "config.model: rotary_dim=4 must be even and in [0, "
           "head_dim=2].")
