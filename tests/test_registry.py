"""The name -> entry table every extension point registers in."""

import pytest

from sao_jax import registry


def _losses():
  return registry.Registry("loss", {"sao": 1, "grpo": 2}, plural="losses",
                           how="register_loss")


def test_register_get_and_names():
  table = _losses()
  assert table.register("dapo", 3) == 3
  assert table.get("grpo") == 2 and "dapo" in table and "nope" not in table
  assert table.names() == ("dapo", "grpo", "sao")  # Sorted.
  assert tuple(table) == ("sao", "grpo", "dapo")  # Registration order.
  assert table.values() == (1, 2, 3) and len(table) == 3


def test_a_taken_name_is_refused_and_the_entry_kept():
  table = registry.Registry("advantage estimator", {"gae": 1}, how="x")
  with pytest.raises(ValueError,
                     match=r"^Advantage estimator 'gae' is already registered"):
    table.register("gae", 2)
  assert table.get("gae") == 1


def test_an_unknown_name_is_refused_naming_the_known_ones_and_how_to_add():
  with pytest.raises(registry.UnknownNameError) as err:
    _losses().get("sa0")
  assert str(err.value) == ("Unknown loss 'sa0'; known losses: grpo, sao. A "
                            "new one is registered with register_loss.")
  assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)


def test_a_copy_registers_apart():
  table = _losses()
  copy = table.copy()
  copy.register("toy", 9)
  assert "toy" in copy and "toy" not in table
  assert copy.get("sao") == 1 and copy.kind == "loss"
  with pytest.raises(registry.UnknownNameError, match="known losses: grpo"):
    table.get("toy")
