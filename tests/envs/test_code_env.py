"""The code tool environment (sao_jax/envs/code_env.py): call formats,
observations, scoring, limits, metrics and config."""

import json
import os

import pytest

from configs import base
from sao_jax import config_validation
from sao_jax.envs import build
from sao_jax.envs import code_env
from sao_jax.envs.base import ChatTemplate
from sao_jax.envs.base import SAO_MARKUP
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks
from sao_jax.sampler.stats import SamplerStats
from sao_jax.sandbox import probe
from sao_jax.sandbox.limits import CallResult

# ChatML as hf_tokenizer.template_from_jinja renders SmolLM2's template.
CHATML = ChatTemplate(
    prompt_prefix="<|im_start|>user\n",
    prompt_suffix="<|im_end|>\n<|im_start|>assistant\n",
    turn_end="<|im_end|>", call_open="<tool_call>", call_close="</tool_call>",
    call_ends_turn=True, result_prefix="\n<|im_start|>tool\n",
    result_suffix="<|im_end|>\n<|im_start|>assistant\n",
    stop_tokens=("<|im_end|>",), special_tokens=("<|im_start|>", "<|im_end|>"))


def _cfg(**overrides):
  cfg = base.get_config()
  cfg.env.name = "code"
  cfg.env.code_wall_s = 1.0
  cfg.env.code_workers = 1
  cfg.env.size, cfg.env.eval_size = 8, 4
  for k, v in overrides.items():
    setattr(cfg.env, k, v)
  return cfg


def test_parse_json_and_markup_calls():
  call = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
  assert code_env.parse_code(json.dumps(call), True) == "print(6 * 7)"
  call["arguments"] = json.dumps({"code": "print(1)"})  # OpenAI style.
  assert code_env.parse_code(json.dumps(call), True) == "print(1)"
  fenced = "```python\nprint(2)\n```"
  assert code_env.parse_code(fenced, False) == "print(2)\n"
  assert code_env.parse_code("print(3)", False) == "print(3)"
  for bad in ("print(1)", '{"name": "calc", "arguments": {"code": "1"}}',
              '{"name": "python", "arguments": {"src": "1"}}',
              '{"name": "python", "arguments": "{oops"}', "[1, 2]"):
    with pytest.raises(code_env.CallError):
      code_env.parse_code(bad, True)


def test_format_observation():
  ok = CallResult("42\n", "", 0)
  assert code_env.format_observation(ok, 512) == "42"
  err = CallResult("", "Traceback...\nZeroDivisionError: division by zero\n", 1)
  assert code_env.format_observation(err, 512) == (
      "stderr: Traceback...\nZeroDivisionError: division by zero\n"
      "[exit status 1]")
  slow = CallResult("partial\n", "", -9, timed_out=True, truncated=True)
  assert code_env.format_observation(slow, 512) == (
      "partial\n[timed out]\n[output truncated]")
  assert code_env.format_observation(CallResult("", "", 0), 512) == (
      "[no output]")
  long = code_env.format_observation(CallResult("x" * 1000, "", 0), 100)
  assert len(long) == 100 and long.endswith("[truncated]")


def test_config_validation_and_keys():
  cfg = _cfg()
  config_validation.validate_config(cfg)
  cfg.env.code_wall_s = 58.0  # + 3 s grace > step_timeout_s = 60.
  with pytest.raises(config_validation.ConfigError, match="code_wall_s"):
    config_validation.validate_config(cfg)
  cfg = _cfg(code_mode="lukewarm")
  with pytest.raises(config_validation.ConfigError, match="code_mode"):
    config_validation.validate_config(cfg)
  limits = code_env.limits_from_config(_cfg(code_wall_s=2.5).env)
  assert (limits.wall_s, limits.cpu_s, limits.memory_mb) == (2.5, 3, 512)


@pytest.fixture(scope="module")
def sandboxed():
  if probe.bwrap_problem() and probe.landlock_problem() and not os.environ.get(
      "CI"):
    pytest.skip(probe.bwrap_problem())
  yield
  code_env.close_pools()


@pytest.mark.multiprocess
@pytest.mark.parametrize("template", [SAO_MARKUP, CHATML],
                         ids=["sao_markup", "chatml"])
def test_episode_tool_call_then_scored_answer(sandboxed, template):
  del sandboxed
  cfg = _cfg()
  tasks = ReasoningGymTasks("basic_arithmetic", {}, seed=3, size=4)
  envs = build.make_envs(cfg.env, tasks, 2)
  assert envs[0].pool is envs[1].pool  # One pool per process.
  env = envs[0]
  env.set_template(template)
  entry = tasks.entry(1)
  env.reset(1)
  expr = entry["question"].split("=")[0].split(":")[-1].strip()
  code = f"print({json.dumps(entry['answer'])})"
  payload = (json.dumps({"name": "python", "arguments": {"code": code}})
             if template is CHATML else code)
  obs, reward, done, info = env.step("Let me compute." +
                                     template.format_tool_call(payload))
  assert obs == template.format_tool_result(entry["answer"]), (expr, obs)
  assert (reward, done, info["tool_result"]) == (0.0, False, entry["answer"])
  _, reward, done, _ = env.step(template.format_assistant_turn(
      entry["answer"]))
  assert (reward, done) == (1.0, True)
  env.reset(1)
  _, reward, done, _ = env.step(template.format_assistant_turn("-1"))
  assert (reward, done) == (0.0, True) or entry["answer"] == "-1"


@pytest.mark.multiprocess
def test_timeouts_refusals_and_metrics(sandboxed):
  del sandboxed
  cfg = _cfg(max_tool_calls=2)
  tasks = ReasoningGymTasks("basic_arithmetic", {}, seed=3, size=4)
  env = build.make_envs(cfg.env, tasks, 1)[0]
  before = code_env.tool_stats()
  env.reset(0)
  obs = env.step(SAO_MARKUP.format_tool_call("while True: pass")).observation
  assert obs == SAO_MARKUP.format_tool_result("[timed out]")
  obs = env.step(SAO_MARKUP.format_tool_call("print('a' * 10**6)")).info
  assert obs["tool_result"].endswith("[truncated]")
  assert len(obs["tool_result"]) == cfg.env.code_observation_chars
  obs = env.step(SAO_MARKUP.format_tool_call("print(1)")).info
  assert obs["tool_result"] == "error: more than 2 tool calls"
  after = code_env.tool_stats()
  assert after["code_calls"] - before["code_calls"] == 2
  assert after["code_timeouts"] - before["code_timeouts"] == 1
  assert after["code_refusals"] - before["code_refusals"] == 1
  assert 0 < after["code_exec_s_p50"] <= after["code_exec_s_p99"]
  assert after["code_exec_s_p99"] >= cfg.env.code_wall_s
  stats = SamplerStats()
  build.publish_metrics(stats)
  assert {n: v for n, _, v in stats.counters()
          if n in code_env.COUNTERS} == after
  assert stats.as_dict()["sampler/code_calls"] == after["code_calls"]


class _CharTokenizer:
  """Just enough of a TextTokenizer for `demonstration`: one id per char."""

  def __init__(self, template):
    self.template = template

  def encode(self, text):
    return [ord(c) for c in text]


@pytest.mark.multiprocess
@pytest.mark.parametrize("template", [SAO_MARKUP, CHATML],
                         ids=["sao_markup", "chatml"])
def test_demonstration_observation_is_what_the_env_returns(sandboxed,
                                                           template):
  """SFT shows the policy exactly the observation RL will see."""
  del sandboxed
  from sao_jax.envs import demonstrations  # pylint: disable=g-import-not-at-top
  cfg = _cfg()
  tasks = ReasoningGymTasks(
      "basic_arithmetic", {"min_terms": 3, "max_terms": 3, "min_digits": 3,
                           "max_digits": 3, "operators": ("+", "-")},
      seed=7, size=6)
  env = build.make_envs(cfg.env, tasks, 1)[0]
  env.set_template(template)
  decode = lambda ids: "".join(map(chr, ids))
  for i in range(len(tasks)):
    segments = demonstrations.demonstration(
        tasks.entry(i), i, _CharTokenizer(template), tool_every=1,
        code_tool=True)
    (prompt, _), (call, trained), (result, observed), (answer, _) = segments
    assert trained and not observed
    assert env.reset(i) == decode(prompt)
    step = env.step(decode(call))
    assert step.observation == decode(result)
    assert step.info["tool_result"] == str(tasks.entry(i)["answer"])
    assert env.step(decode(answer)).reward == 1.0
