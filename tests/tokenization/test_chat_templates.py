"""Real chat templates (Qwen3, Gemma 3, Llama 3.2) vs `apply_chat_template`.

Each family's template (tests/fixtures/chat_templates/, origin in its
README) runs on a tiny tokenizer built offline (tests/family_tokenizers.py);
ours is `HFTokenizer` (tokenizers + jinja2 only), the reference transformers'
`AutoTokenizer` of the same directory. An episode is written segment by
segment as the sampler writes it (prompt, action, observation, action) and
must equal transformers' rendering of the same conversation, text and ids.
"""

import ml_collections
import pytest

from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import tool_env
from sao_jax.tokenization import hf_tokenizer
from sao_jax.tokenization import jinja_template
from sao_jax.tokenization import text_tokenizer
from sao_jax.tokenization import tokenizer as tok_lib

import family_tokenizers

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.ref

CALC = jinja_template.CALCULATOR_TOOL
DATE = {"date_string": "26 Jul 2024"}  # Llama 3: no strftime_now in tests.


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("families")
  return {f: family_tokenizers.build(f, root / f)
          for f in family_tokenizers.FAMILIES}


@pytest.fixture(scope="module")
def refs(dirs):
  return {f: transformers.AutoTokenizer.from_pretrained(d)
          for f, d in dirs.items()}


def _ref_text(ref, messages, generation_prompt, **kwargs):
  return ref.apply_chat_template(messages, tokenize=False,
                                 add_generation_prompt=generation_prompt,
                                 **kwargs)


def _ref_ids(ref, messages, generation_prompt, **kwargs):
  out = ref.apply_chat_template(messages, tokenize=True,
                                add_generation_prompt=generation_prompt,
                                **kwargs)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check_episode(ours, ref, segments, messages, **kwargs):
  """Segments joined (and encoded one by one) == the whole conversation."""
  want = _ref_text(ref, messages, False, **kwargs)
  text = "".join(segments)
  assert want.startswith(text)
  assert want[len(text):] in ("", "\n")  # A template may end turns with \n.
  ids = [i for s in segments for i in ours.encode(s)]
  assert ids + ours.encode(want[len(text):]) == _ref_ids(
      ref, messages, False, **kwargs)
  assert ours.decode(ids) == text


@pytest.mark.parametrize("family,kwargs", [
    ("qwen3", {}), ("qwen3", {"enable_thinking": False}),
    ("qwen3", {"enable_thinking": True}), ("gemma3", {}), ("llama3", DATE)])
@pytest.mark.parametrize("system", ["", "Answer with a number."])
def test_prompt_matches_apply_chat_template(dirs, refs, family, kwargs,
                                            system):
  ours = hf_tokenizer.HFTokenizer.load(dirs[family], kwargs, system)
  head = [{"role": "system", "content": system}] if system else []
  for question in ["What is 12 + 7?", "émoji 🤖\nline two", "  padded  "]:
    messages = head + [{"role": "user", "content": question}]
    text = ours.template.format_prompt(question)
    assert text == _ref_text(refs[family], messages, True, **kwargs)
    assert ours.encode(text) == _ref_ids(refs[family], messages, True,
                                         **kwargs)


def test_stop_token_comes_from_the_template(dirs, refs):
  want = {"qwen3": "<|im_end|>", "gemma3": "<end_of_turn>",
          "llama3": "<|eot_id|>"}
  for family, stop in want.items():
    ours = hf_tokenizer.HFTokenizer.load(dirs[family], DATE)
    ref = refs[family]
    assert ours.template.turn_end == stop
    assert ours.stop_ids[0] == ref.convert_tokens_to_ids(stop)
    assert ours.eos_id == ref.eos_token_id
  # Gemma's eos is not its turn end: both stop, the turn end first.
  gemma = hf_tokenizer.HFTokenizer.load(dirs["gemma3"])
  assert gemma.stop_ids == (refs["gemma3"].convert_tokens_to_ids(
      "<end_of_turn>"), refs["gemma3"].convert_tokens_to_ids("<eos>"))


def test_qwen3_thinking_switch(dirs):
  on = hf_tokenizer.HFTokenizer.load(dirs["qwen3"])
  off = hf_tokenizer.HFTokenizer.load(dirs["qwen3"],
                                      {"enable_thinking": False})
  assert on.template.prompt_suffix == "<|im_end|>\n<|im_start|>assistant\n"
  assert off.template.prompt_suffix == (on.template.prompt_suffix
                                        + "<think>\n\n</think>\n\n")
  assert off.template.result_suffix.endswith("<think>\n\n</think>\n\n")


def _qwen3_call_messages(think):
  call = {"role": "assistant", "content": f"{think}Let me compute.",
          "tool_calls": [{"type": "function", "function": {
              "name": "calculator", "arguments": {"expression": "12 + 7"}}}]}
  return [{"role": "user", "content": "What is 12 + 7?"}, call,
          {"role": "tool", "content": "19"}]


def test_qwen3_tool_episode_with_thinking(dirs, refs):
  ours = hf_tokenizer.HFTokenizer.load(dirs["qwen3"], tools=[CALC])
  t = ours.template
  assert t.call_json_arg == "expression"
  think = "<think>\nAdd them.\n</think>\n\n"
  action = f"{think}Let me compute.\n" + t.format_tool_call("12 + 7")
  assert t.is_tool_call(action) and t.parse_tool_call(action) == "12 + 7"
  answer = "<think>\nDone.\n</think>\n\n19"
  segments = [t.format_prompt("What is 12 + 7?"), action,
              t.format_tool_result("19"), t.format_assistant_turn(answer)]
  messages = _qwen3_call_messages(think) + [
      {"role": "assistant", "content": answer}]
  _check_episode(ours, refs["qwen3"], segments, messages, tools=[CALC])


def test_qwen3_tool_observation_with_thinking_off(dirs, refs):
  """Thinking off, Qwen3's template re-renders an earlier turn without its
  empty think block; the observation is what it appends after the call."""
  kwargs = {"enable_thinking": False}
  ours = hf_tokenizer.HFTokenizer.load(dirs["qwen3"], kwargs, tools=[CALC])
  t = ours.template
  rendered = _ref_text(refs["qwen3"], _qwen3_call_messages(""), True,
                       tools=[CALC], **kwargs)
  call = "Let me compute.\n" + t.format_tool_call("12 + 7")
  assert call in rendered
  assert rendered.split(call, 1)[1] == t.format_tool_result("19")
  assert rendered.startswith(t.format_prompt("What is 12 + 7?")[
      :-len("<think>\n\n</think>\n\n")])


def test_json_tool_call_parsing(dirs):
  t = hf_tokenizer.HFTokenizer.load(dirs["qwen3"], tools=[CALC]).template
  spaced = ('<tool_call>\n{"name": "calculator", "arguments": '
            '"{\\"expression\\": \\"2 * 3\\"}"}\n</tool_call><|im_end|>')
  assert t.parse_tool_call(spaced) == "2 * 3"  # Arguments as a JSON string.
  assert t.is_tool_call(spaced)
  assert t.parse_tool_call("<tool_call>2 * 3</tool_call>") is None
  assert not t.is_tool_call('<tool_call>{"name": "calculator"}</tool_call>')
  quoted = t.format_tool_call('say "hi"\n')
  assert t.parse_tool_call(quoted) == 'say "hi"\n'


def test_gemma3_folds_system_and_takes_tool_values_as_user_turns(dirs, refs):
  ours = hf_tokenizer.HFTokenizer.load(dirs["gemma3"], system="Be brief.")
  t = ours.template
  assert t.prompt_prefix == "<bos><start_of_turn>user\nBe brief.\n\n"
  assert "system" not in t.prompt_prefix
  with pytest.raises(Exception, match="alternate"):
    _ref_text(refs["gemma3"], [{"role": "user", "content": "Q"},
                               {"role": "assistant", "content": "A"},
                               {"role": "tool", "content": "19"}], True)
  segments = [t.format_prompt("What is 12 + 7?"),
              "Let me compute. " + t.format_tool_call("12 + 7"),
              t.format_tool_result("19"), t.format_assistant_turn("19")]
  messages = [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "What is 12 + 7?"},
      {"role": "assistant",
       "content": "Let me compute. <tool_call>12 + 7</tool_call>"},
      {"role": "user", "content": "19"},
      {"role": "assistant", "content": "19"}]
  _check_episode(ours, refs["gemma3"], segments, messages)


def test_llama3_headers_and_ipython_turn(dirs, refs):
  ours = hf_tokenizer.HFTokenizer.load(dirs["llama3"], DATE)
  t, ref = ours.template, refs["llama3"]
  for header in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
    assert ours.token_id(header) == ref.convert_tokens_to_ids(header)
  assert t.prompt_suffix == (
      "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
  value = 'a "quoted"\nvalue'  # The ipython turn writes it as JSON.
  segments = [t.format_prompt("What is 12 + 7?"),
              t.format_tool_call("12 + 7"), t.format_tool_result(value),
              t.format_assistant_turn("19")]
  messages = [
      {"role": "user", "content": "What is 12 + 7?"},
      {"role": "assistant", "content": "<tool_call>12 + 7</tool_call>"},
      {"role": "tool", "content": value},
      {"role": "assistant", "content": "19"}]
  _check_episode(ours, ref, segments, messages, **DATE)


def test_serialized_tokenizer_keeps_template_inputs(dirs):
  ours = hf_tokenizer.HFTokenizer.load(dirs["qwen3"], {
      "enable_thinking": False}, "Be brief.", [CALC])
  again = text_tokenizer.from_serialized(ours.serialized_proto())
  assert again.template == ours.template
  assert again.template.call_json_arg == "expression"


def test_tokenizer_from_config_reads_the_env_section(dirs, tmp_path):
  env = ml_collections.ConfigDict({
      "name": "tool", "chat_template_kwargs": {"enable_thinking": False},
      "system_prompt": "Use the calculator."})
  cfg = ml_collections.ConfigDict({"path": str(dirs["qwen3"])})
  tok = tok_lib.tokenizer_from_config(cfg, tmp_path, env)
  assert tok.template.call_json_arg == "expression"
  assert tok.template.prompt_suffix.endswith("<think>\n\n</think>\n\n")
  assert tok.template.prompt_prefix.startswith(
      "<|im_start|>system\nUse the calculator.\n\n# Tools")
  env.name = "reasoning_gym"  # No tool: no declaration, plain markup.
  plain = tok_lib.tokenizer_from_config(cfg, tmp_path, env)
  assert plain.template.call_json_arg == ""
  assert "# Tools" not in plain.template.prompt_prefix


def test_tool_env_runs_a_qwen3_json_call(dirs):
  ours = hf_tokenizer.HFTokenizer.load(dirs["qwen3"], tools=[CALC])
  tasks = reasoning_gym_env.ReasoningGymTasks(
      "basic_arithmetic", {"min_terms": 2, "max_terms": 2}, seed=3, size=2)
  env = tool_env.ToolEnv(tasks)
  env.set_template(ours.template)
  entry = tasks.entry(0)
  env.reset(0)
  call = ours.decode(ours.encode(ours.template.format_tool_call(
      entry["metadata"]["expression"])))
  obs, reward, done, _ = env.step(call)
  assert not done and reward == 0.0
  assert obs == ours.template.format_tool_result(str(entry["answer"]))
  _, reward, done, _ = env.step(str(entry["answer"]) + "<|im_end|>")
  assert done and reward == 1.0
