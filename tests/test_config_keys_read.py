"""Every key of configs/base.py is read by the package (no dead settings).

A key ``section.leaf`` counts as read when some module of sao_jax/ other than
config_validation.py (which checks keys, it does not use them) reads it:

* as an attribute, subscript or ``.get`` of the section: ``config.rl.gamma``,
  ``c.rl["gamma"]``, or through a local alias (``t = config.train;
  t.sft_steps``);
* inside a function that is handed the section (``SECTION_FUNCTIONS``; or a
  method of a name in ``SECTION_METHODS``, whatever its class), as an
  attribute of its parameter or ``_get(param, "leaf")``;
* or dynamically, where the code spreads a whole group (``DYNAMIC_READS``):
  the ModelConfig fields, the hyper-parameters of the registered losses, the
  keyword arguments of ``optim.make_optimizer``, the mesh axes (the
  trainer's and the sampler's).

This would have caught the four dead keys of issue 14: on the tree before it
(``git archive 09524b3 sao_jax configs``, with ``envs/from_config.py`` in
``SECTION_FUNCTIONS`` for ``envs/build.py``), ``unread_keys(old_base,
package_reads(old_sao_jax))`` returned exactly ``env.tool_timeout_s``,
``model.name``, ``rl.log_entropy`` and ``sampler.min_prompt_bucket``.
``test_detects_a_dead_key`` checks the mechanism on keys added here.
"""

import ast
import dataclasses
import inspect
import pathlib

from sao_jax import config_validation as cv
from sao_jax import sharding
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.rl import registry
from sao_jax.sampler import mesh as sampler_mesh
from sao_jax.train import optim

_PKG = pathlib.Path(__file__).resolve().parents[1] / "sao_jax"

# (module path under sao_jax/, function name) -> the section it is handed.
SECTION_FUNCTIONS = {
    ("tokenization/tokenizer.py", "tokenizer_from_config"): "tokenizer",
    ("tokenization/tokenizer.py", "_template_settings"): "env",
    ("sharding.py", "initialize_distributed"): "distributed",
    ("sharding.py", "make_mesh"): "mesh",
    ("envs/build.py", "build_tasks"): "env",
    ("envs/build.py", "make_envs"): "env",
    ("envs/code_env.py", "limits_from_config"): "env",
    ("envs/code_env.py", "shared_pool"): "env",
}
# Method name -> the section it is handed, in whatever class defines it:
# each environment reads its own settings (``Environment.config_kwargs``).
SECTION_METHODS = {"config_kwargs": "env"}


# ConfigDict methods: calling one reads no key.
_METHODS = frozenset(("get", "get_ref", "items", "keys", "values", "lock",
                      "unlock", "to_dict", "to_json_best_effort"))


def _dynamic_reads() -> set[str]:
  reads = {f"model.{f.name}" for f in dataclasses.fields(ModelConfig)}
  # ModelConfig.from_config spreads config.model.moe into MoeConfig.
  reads |= {f"model.moe.{f.name}" for f in dataclasses.fields(MoeConfig)}
  reads |= {f"rl.{k}" for name in registry.known_losses()
            for k in registry.get_spec(name).defaults}
  params = inspect.signature(optim.make_optimizer).parameters
  reads |= {f"optim.{k}" for k in params if k != "lr"}
  reads |= {f"mesh.{a}" for a in sharding.MESH_AXES}
  # sampler/mesh.py's mesh_sizes reads each of sampler.mesh's FIELDS.
  reads |= {f"sampler.mesh.{f}" for f in sampler_mesh.FIELDS}
  return reads


def _string(node) -> str | None:
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return node.value
  return None


def _reads_in(tree: ast.AST, sections: set[str],
              params: dict[str, str]) -> set[str]:
  """Dotted keys read in ``tree``; ``params`` maps names to their section."""
  aliases = dict(params)
  for node in ast.walk(tree):  # alias = <...>.section
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr in sections):
      aliases[node.targets[0].id] = node.value.attr

  def section_of(expr) -> str | None:
    if isinstance(expr, ast.Attribute) and expr.attr in sections:
      return expr.attr
    if isinstance(expr, ast.Name):
      return aliases.get(expr.id)
    return None

  reads = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and section_of(node.value)
        and node.attr not in _METHODS):
      reads.add(f"{section_of(node.value)}.{node.attr}")
    elif isinstance(node, ast.Subscript) and section_of(node.value):
      if (leaf := _string(node.slice)) is not None:
        reads.add(f"{section_of(node.value)}.{leaf}")
    elif isinstance(node, ast.Call) and node.args:
      func = node.func
      if (isinstance(func, ast.Attribute) and func.attr == "get"
          and section_of(func.value) and _string(node.args[0])):
        reads.add(f"{section_of(func.value)}.{_string(node.args[0])}")
      elif (isinstance(func, ast.Name) and func.id == "_get"
            and len(node.args) > 1 and section_of(node.args[0])
            and _string(node.args[1])):
        reads.add(f"{section_of(node.args[0])}.{_string(node.args[1])}")
  return reads


def package_reads(package: pathlib.Path = _PKG,
                  sections: set[str] | None = None) -> set[str]:
  """Every ``section.leaf`` the modules of ``package`` read."""
  sections = sections or set(cv.base_config().keys())
  reads = _dynamic_reads()
  for path in sorted(package.rglob("*.py")):
    rel = path.relative_to(package).as_posix()
    if rel == "config_validation.py":
      continue
    tree = ast.parse(path.read_text(), filename=str(path))
    reads |= _reads_in(tree, sections, {})
    for node in ast.walk(tree):
      name = getattr(node, "name", None)
      section = SECTION_FUNCTIONS.get((rel, name)) or SECTION_METHODS.get(name)
      if section and isinstance(node, ast.FunctionDef):
        param = next(a.arg for a in node.args.args
                     if a.arg not in ("self", "cls"))
        reads |= {f"{section}.{k.split('.', 1)[1]}"
                  for k in _reads_in(node, {section}, {param: section})}
  return reads


def unread_keys(base=None, reads: set[str] | None = None) -> list[str]:
  """Leaf keys of the base config that nothing in sao_jax/ reads."""
  base = cv.base_config() if base is None else base
  reads = package_reads() if reads is None else reads
  free_form = tuple(f + "." for f in cv.FREE_FORM)
  return sorted(
      path for path in _leaf_paths(base)
      if path not in reads and not path.startswith(free_form)
      and path not in cv.FREE_FORM)


def _leaf_paths(cfg, prefix=""):
  for key, value in cfg.items():
    if hasattr(value, "items") and f"{prefix}{key}" not in cv.FREE_FORM:
      yield from _leaf_paths(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}"


def test_every_base_key_is_read():
  assert unread_keys() == []


def test_detects_a_dead_key():
  base = cv.base_config()
  base.rl.log_entropy = True  # One of the dead keys issue 14 removed.
  base.sampler.unused_knob = 3
  assert unread_keys(base) == ["rl.log_entropy", "sampler.unused_knob"]


def test_reads_follow_aliases_sections_handed_over_and_get():
  tree = ast.parse(
      "def f(config):\n"
      "  t = config.train\n"
      "  return t.seed, config.rl['gamma'], config.env.get('size')\n")
  assert _reads_in(tree, {"train", "rl", "env"}, {}) == {
      "train.seed", "rl.gamma", "env.size"}
