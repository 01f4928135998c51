"""Tests for sao_jax.envs: calculator, reasoning-gym adapter, tool env, evolving env."""

import operator
import pathlib
import subprocess
import sys

import hypothesis
from hypothesis import strategies as st
import ml_collections
import pytest
import reasoning_gym

from configs import base as base_config
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import base
from sao_jax.envs import build
from sao_jax.envs import evolving
from sao_jax import reasoning_gym_import
from sao_jax.envs import reasoning_gym_env as rg_env
from sao_jax.envs import registry
from sao_jax.envs import tool_env


@pytest.fixture(scope="module")
def tasks():
  return rg_env.ReasoningGymTasks("basic_arithmetic", {"max_terms": 4},
                                  seed=10, size=8)


@pytest.mark.parametrize("expr,value", [
    ("3*(4+5)", 27), ("-2**3", -8), ("7//2", 3), ("7 % 3", 1), ("1/4", 0.25),
    ("-(2 - 10) * +3", 24), ("2**-1", 0.5), ("1.5e3 + 1", 1501.0),
    ("2 ** 64", 2**64),
])
def test_calculate_values(expr, value):
  got = tool_env.calculate(expr)
  assert got == value and type(got) is type(value)


@pytest.mark.parametrize("expr,msg", [
    ("__import__('os').system('x')", "Call"), ("a + 1", "Name"),
    ("2 ** 65", "exponent"), ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"), ("True + 1", "not a number"),
    ("'a' * 3", "not a number"), ("(-8) ** 0.5", "not a real number"),
    ("10**60 * 10**10", "exceeds"), ("(1).real", "Attribute"),
    ("[1, 2]", "List"), ("1 if 1 else 2", "IfExp"), ("3 +", "cannot parse"),
    ("1+" * 200 + "1", "longer than"), ("2 < 3", "Compare"),
    ("1e999", "not finite"), ("1e300", "exceeds"),
])
def test_calculate_rejects(expr, msg):
  with pytest.raises(tool_env.CalculatorError, match=msg):
    tool_env.calculate(expr)


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@st.composite
def _expr(draw, depth=0):
  """(text, value) of a random integer expression."""
  if depth >= 3 or draw(st.booleans()):
    v = draw(st.integers(-999, 999))
    return (f"({v})" if v < 0 else str(v)), v
  op = draw(st.sampled_from(sorted(_OPS)))
  (lt, lv), (rt, rv) = draw(_expr(depth + 1)), draw(_expr(depth + 1))
  return f"({lt} {op} {rt})", _OPS[op](lv, rv)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(_expr())
def test_calculate_matches_python_arithmetic(case):
  text, value = case
  assert tool_env.calculate(text) == value


def test_format_number():
  assert tool_env.format_number(27) == "27"
  assert tool_env.format_number(4.0) == "4"
  assert tool_env.format_number(0.1 + 0.2) == "0.3"
  assert tool_env.format_number(1 / 3) == "0.333333333333"


def test_final_answer_rule():
  r = tok_lib.TOOL_RESULT + "27" + tok_lib.TOOL_RESULT_END
  assert base.final_answer(" 42 " + tok_lib.END) == "42"
  assert base.final_answer("a" + r + " 27\n" + tok_lib.END + "junk") == "27"
  assert base.final_answer("plain") == "plain"


def test_reasoning_gym_env_scores_with_dataset(tasks):
  env = registry.make_env("reasoning_gym", tasks, reward="score")
  ref = reasoning_gym.create_dataset("basic_arithmetic", seed=10, size=8,
                                     max_terms=4)
  for i in (0, 3):
    entry = ref[i]
    prompt = env.reset(i)
    assert prompt == tok_lib.format_prompt(entry["question"])
    assert env.prompt_id == 10 + i
    obs, reward, done, info = env.step(entry["answer"] + tok_lib.END)
    assert (obs, reward, done, info["answer"]) == ("", 1.0, True,
                                                   entry["answer"])
    env.reset(i)
    wrong = "x" + entry["answer"]  # reasoning-gym gives partial credit here.
    _, reward, _, _ = env.step(wrong)
    assert reward == pytest.approx(ref.score_answer(wrong, entry))
    assert 0 < reward < 1
  with pytest.raises(RuntimeError, match="before reset"):
    env.step("1")


def test_train_eval_split_disjoint():
  train, ev = rg_env.train_eval_split(
      "chain_sum", None, train_seed=0, train_size=100, eval_seed=100,
      eval_size=20)
  assert set(train.item_seeds()).isdisjoint(ev.item_seeds())
  assert ev.entry(0) == reasoning_gym.create_dataset(
      "chain_sum", seed=100, size=1)[0]
  with pytest.raises(ValueError, match="overlap"):
    rg_env.train_eval_split("chain_sum", None, train_seed=0, train_size=100,
                            eval_seed=99, eval_size=20)
  with pytest.raises(ValueError, match="overlap"):
    rg_env.train_eval_split("chain_sum", None, train_seed=50, train_size=10,
                            eval_seed=40, eval_size=11)
  with pytest.raises(ValueError, match="Cannot create"):
    rg_env.ReasoningGymTasks("no_such_dataset", None, seed=0, size=1)


def test_tool_env_calculator_then_answer(tasks):
  env = registry.make_env("tool", tasks, max_tool_calls=2)
  assert env.name == "basic_arithmetic+calc"
  entry = tasks.entry(2)
  env.reset(2)
  call = "Let me compute. " + tok_lib.format_tool_call(
      entry["metadata"]["expression"])
  obs, reward, done, info = env.step(call)
  assert not done and reward == 0.0
  assert obs == tok_lib.format_tool_result(entry["answer"])
  obs, _, done, _ = env.step(tok_lib.format_tool_call("1/0"))
  assert obs == tok_lib.format_tool_result("error: division by zero")
  obs, _, _, _ = env.step(tok_lib.format_tool_call("1+1"))
  assert "more than 2 tool calls" in obs
  _, reward, done, _ = env.step(entry["answer"] + tok_lib.END)
  assert done and reward == 1.0


def test_evolving_reward_flips_at_switch_boundaries(tasks):
  env = registry.make_env("evolving", tasks,
                          styles=("boxed", "answer_tag", "plain"),
                          switch_at=(100, 200))
  ans = tasks.entry(1)["answer"]
  forms = {"boxed": "\\boxed{%s}" % ans, "answer_tag": f"<answer>{ans}</answer>",
           "plain": ans}
  expected_style = {0: "boxed", 99: "boxed", 100: "answer_tag",
                    199: "answer_tag", 200: "plain", 10**6: "plain"}
  for version, want in expected_style.items():
    for style, text in forms.items():
      env.reset(1)
      env.set_policy_version(version)
      _, reward, done, info = env.step(text + tok_lib.END)
      assert done and info["required_style"] == want
      assert reward == (1.0 if style == want else 0.0), (version, style)
  env.reset(1)
  env.set_policy_version(150)
  _, reward, _, info = env.step("<answer>%s9</answer>" % ans)  # Wrong value.
  assert reward == 0.0 and info["r_style"] == 1.0 and info["r_quality"] == 0.0
  with pytest.raises(ValueError, match="switch points"):
    evolving.EvolvingEnv(tasks, styles=("boxed", "plain"), switch_at=(1, 2))
  with pytest.raises(ValueError, match="Unknown styles"):
    evolving.EvolvingEnv(tasks, styles=("bold",), switch_at=())


def test_evolving_reads_the_wrapper_around_a_chatty_replys_last_number(tasks):
  env = registry.make_env("evolving", tasks, styles=("plain", "boxed",
                                                     "answer_tag"),
                          switch_at=(10, 20), answer="last_number")
  ans = tasks.entry(1)["answer"]
  replies = {  # reply -> (style, rewarded at versions 0, 10, 20)
      f"Adding them gives {ans}.": ("plain", (1, 0, 0)),
      f"So the sum is \\boxed{{{ans}}}, done.": ("boxed", (0, 1, 0)),
      f"The answer: <answer> {ans} </answer>": ("answer_tag", (0, 0, 1)),
      # The last number decides: a boxed first try, then a plain correction.
      f"\\boxed{{{ans}9}} no, it is {ans}": ("plain", (1, 0, 0)),
      f"<answer>{ans}9</answer>": ("answer_tag", (0, 0, 0)),  # Wrong value.
      "I cannot tell.": ("plain", (0, 0, 0)),
  }
  for reply, (style, rewarded) in replies.items():
    for version, want in zip((0, 10, 20), rewarded):
      env.reset(1)
      env.set_policy_version(version)
      _, reward, done, info = env.step(reply + tok_lib.END)
      assert done and info["style"] == style, reply
      assert reward == want, (reply, version)
  with pytest.raises(ValueError, match="last_number"):
    evolving.EvolvingEnv(tasks, styles=("plain",), switch_at=(),
                         answer="answer_tag")


def test_registry():
  assert set(registry.available_envs()) >= {"reasoning_gym", "tool", "evolving"}
  with pytest.raises(KeyError, match="registered"):
    registry.make_env("nope")
  with pytest.raises(ValueError, match="already registered"):
    registry.register_env("tool", tool_env.ToolEnv)


@pytest.mark.parametrize("name,want", [
    ("reasoning_gym", {"answer_rule": "last_number", "reward": "exact"}),
    ("tool", {"max_tool_calls": 3, "answer_rule": "last_number"}),
    ("tool_longtail", {"max_tool_calls": 3, "min_tokens": 4, "levels": 2,
                       "tool_calls": 1, "tool_latency_s": 0.5}),
    ("evolving", {"styles": ("plain", "boxed"), "switch_at": (7,),
                  "answer_rule": "last_number"}),
])
def test_make_envs_reads_each_env_settings_from_its_section(tasks, name, want):
  env_cfg = base_config.get_config().env
  env_cfg.update(name=name, instruction=" Go.", answer="last_number",
                 reward="score", max_tool_calls=3, longtail_min_tokens=4,
                 longtail_levels=2, longtail_tool_calls=1,
                 longtail_tool_latency_s=0.5, styles=("plain", "boxed"),
                 style_change_steps=(7,))
  envs = build.make_envs(env_cfg, tasks, 2, reward="exact")
  assert len(envs) == 2 and envs[0] is not envs[1]
  assert type(envs[0]) is registry.get_env(name)
  for key, value in {"instruction": " Go.", **want}.items():
    assert getattr(envs[0], key) == value, key


class _ToyEnv(base.Environment):
  """Echo the task's answer for a reward of `bonus` (a setting of its own)."""

  def __init__(self, tasks, instruction="", bonus=0.0):
    self.tasks, self.instruction, self.bonus = tasks, instruction, bonus

  @classmethod
  def config_kwargs(cls, env_cfg, reward):
    return {**super().config_kwargs(env_cfg, reward),
            "bonus": float(env_cfg.toy_bonus)}

  def reset(self, task):
    self.prompt_id, self._answer = task, self.tasks.entry(task)["answer"]
    return self.tasks.entry(task)["question"] + self.instruction

  def step(self, action_text):
    ok = base.final_answer(action_text) == self._answer
    return base.StepResult("", self.bonus if ok else 0.0, True, {})


def test_a_new_env_is_one_registry_entry(tasks, monkeypatch):
  # Registered and built from its config section, nothing else touched.
  monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())
  registry.register_env("toy", _ToyEnv)
  env_cfg = ml_collections.ConfigDict(
      {"name": "toy", "instruction": " (toy)", "toy_bonus": 0.5})
  env = build.make_envs(env_cfg, tasks, 1)[0]
  assert env.reset(3) == tasks.entry(3)["question"] + " (toy)"
  assert env.step(tasks.entry(3)["answer"]).reward == 0.5
  env.reset(3)
  assert env.step("no").reward == 0.0


def _fresh(code: str) -> list[str]:
  """``code``'s printed words in a fresh interpreter (the suite's own may
  have imported anything)."""
  got = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, timeout=300,
                       cwd=pathlib.Path(__file__).resolve().parents[2])
  return got.stdout.split()


def test_reasoning_gym_loads_cellpylib_only_for_game_of_life():
  assert _fresh(
      "import sys; from sao_jax import reasoning_gym_import as r; "
      "from sao_jax.envs import reasoning_gym_env as e; "
      "r.import_reasoning_gym(); print('matplotlib' in sys.modules); "
      "t = e.ReasoningGymTasks('game_of_life', seed=3, size=2); "
      "x = t.entry(1); print(t.dataset.score_answer(x['answer'], x)); "
      "print('matplotlib' in sys.modules)") == ["False", "1.0", "True"]


def test_the_dataset_index_is_reasoning_gyms_registry():
  # reasoning_gym_import reads names and subpackages from the sources: each
  # registered dataset's class lives in the subpackage it names (None: a
  # top-level module, composite, which needs the whole package).
  index = reasoning_gym_import.dataset_subpackages()
  assert set(index) == set(reasoning_gym.factory.DATASETS)
  assert len(index) >= 100 and index["basic_arithmetic"] == (
      "reasoning_gym.arithmetic") and index["composite"] is None
  for name, (cls, _) in reasoning_gym.factory.DATASETS.items():
    where = index[name] or cls.__module__
    assert cls.__module__.startswith(where), (name, where, cls.__module__)


def test_a_run_imports_only_its_datasets_subpackages():
  # basic_arithmetic's tasks from reasoning_gym.arithmetic alone: no sympy
  # (the algebra, geometry and games subpackages'), the same problems as
  # the whole package makes; another name, or any attribute the partial
  # package lacks, imports the rest.
  words = _fresh(
      "import sys; from sao_jax import reasoning_gym_import as r; "
      "from sao_jax.envs import reasoning_gym_env as e; "
      "rg = r.import_reasoning_gym(['basic_arithmetic']); "
      "print('sympy' in sys.modules, 'reasoning_gym.algebra' in sys.modules); "
      "t = e.ReasoningGymTasks('basic_arithmetic', seed=5, size=3); "
      "print(*[t.entry(i)['answer'] for i in range(3)], sep=' '); "
      "d = rg.create_dataset('letter_counting', seed=1, size=1); "
      "print(len(rg.factory.DATASETS) < 60, 'sympy' in sys.modules); "
      "print(rg.__version__, 'sympy' in sys.modules, "
      "len(rg.factory.DATASETS))")
  whole = rg_env.ReasoningGymTasks("basic_arithmetic", seed=5, size=3)
  assert words == ["False", "False", *[whole.entry(i)["answer"]
                                       for i in range(3)],
                   "True", "False", reasoning_gym.__version__, "True",
                   str(len(reasoning_gym.factory.DATASETS))], words
