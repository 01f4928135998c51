"""The pretrained model's own tokenizer and chat template vs transformers.

Reference: `transformers.AutoTokenizer` of the converted SmolLM2 directory and
its `apply_chat_template`; ours uses only `tokenizers` and jinja2.
"""

import pytest

from sao_jax.tokenization import hf_tokenizer
from sao_jax.tokenization import jinja_template
from sao_jax.tokenization import text_tokenizer
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import tool_env

import smollm2_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.ref

TEXTS = ["What is 12 + 7?", "  leading and trailing  \n\n", "émoji 🤖 and 中文",
         "Line1\nLine2\tTab", "Compute 3 * (4 - 1) = ?", ""]


@pytest.fixture(scope="module")
def model_dir(pytestconfig):
  return smollm2_checkpoint.converted_dir(pytestconfig)


@pytest.fixture(scope="module")
def ours(model_dir):
  return hf_tokenizer.HFTokenizer.load(model_dir)


@pytest.fixture(scope="module")
def ref(model_dir):
  return transformers.AutoTokenizer.from_pretrained(model_dir)


def _ref_text(ref, messages, generation_prompt):
  return ref.apply_chat_template(messages, tokenize=False,
                                 add_generation_prompt=generation_prompt)


def _ref_ids(ref, messages, generation_prompt):
  out = ref.apply_chat_template(messages, tokenize=True,
                                add_generation_prompt=generation_prompt)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_converter_takes_eos_from_the_chat_template(model_dir):
  # transformers 5.17 converts SmolLM2's GGUF with eos '<|im_start|>' (seen
  # on an accelerator machine, 2026-11-30); the converter must repair that.
  from sao_jax.models import convert  # pylint: disable=g-import-not-at-top
  wrong = transformers.AutoTokenizer.from_pretrained(model_dir)
  wrong.eos_token = "<|im_start|>"
  convert.align_eos_with_chat_template(wrong)
  assert wrong.eos_token == "<|im_end|>"
  assert wrong.eos_token_id == wrong.convert_tokens_to_ids("<|im_end|>")


def test_special_ids_and_stop_token(ours, ref):
  assert ours.vocab_size == 49152 == len(ref)
  im_end = ref.convert_tokens_to_ids("<|im_end|>")
  assert ours.eos_id == ref.eos_token_id == im_end
  assert ours.stop_ids == (im_end,)
  assert ours.token_id("<|im_start|>") == ref.convert_tokens_to_ids(
      "<|im_start|>")
  assert ours.pad_id == ref.pad_token_id
  with pytest.raises(KeyError, match="not a special token"):
    ours.token_id("<|user|>")
  assert ours.template.turn_end == "<|im_end|>"
  assert isinstance(ours, text_tokenizer.TextTokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(ours, ref, text):
  ids = ours.encode(text)
  assert ids == ref.encode(text, add_special_tokens=False)
  assert ours.decode(ids) == text


def test_prompt_matches_apply_chat_template(ours, ref):
  for question in TEXTS[:4]:
    messages = [{"role": "user", "content": question}]
    text = ours.template.format_prompt(question)
    assert text == _ref_text(ref, messages, True)
    assert ours.encode(text) == _ref_ids(ref, messages, True)


def test_tool_episode_matches_apply_chat_template(ours, ref):
  """Prompt, tool call, observation and answer, encoded segment by segment
  as the sampler does, equal the whole conversation rendered by transformers."""
  t = ours.template
  segments = [t.format_prompt("What is 12 + 7?"),
              "I will compute it. " + t.format_tool_call("12 + 7"),
              t.format_tool_result("19"), t.format_assistant_turn("19")]
  messages = [
      {"role": "user", "content": "What is 12 + 7?"},
      {"role": "assistant",
       "content": "I will compute it. <tool_call>12 + 7</tool_call>"},
      {"role": "tool", "content": "19"},
      {"role": "assistant", "content": "19"}]
  want = _ref_text(ref, messages, False)
  assert "".join(segments) + "\n" == want  # The template ends turns with \n.
  ids = [i for s in segments for i in ours.encode(s)]
  assert ids + ours.encode("\n") == _ref_ids(ref, messages, False)
  assert ours.decode(ids) == "".join(segments)


def test_serialized_round_trip(ours):
  again = text_tokenizer.from_serialized(ours.serialized_proto())
  assert isinstance(again, hf_tokenizer.HFTokenizer)
  assert again.template == ours.template
  assert again.encode(TEXTS[2]) == ours.encode(TEXTS[2])


def test_tokenizer_from_config_reads_a_model_directory(model_dir, tmp_path):
  import ml_collections  # pylint: disable=g-import-not-at-top
  cfg = ml_collections.ConfigDict({"path": model_dir})
  tok = tok_lib.tokenizer_from_config(cfg, tmp_path)
  assert isinstance(tok, hf_tokenizer.HFTokenizer)


def test_tool_env_speaks_the_models_template(ours, ref):
  tasks = reasoning_gym_env.ReasoningGymTasks(
      "basic_arithmetic", {"min_terms": 2, "max_terms": 2}, seed=3, size=2)
  env = tool_env.ToolEnv(tasks)
  env.set_template(ours.template)
  entry = tasks.entry(0)
  prompt = env.reset(0)
  assert prompt == _ref_text(
      ref, [{"role": "user", "content": entry["question"]}], True)
  call = ours.decode(ours.encode(ours.template.format_tool_call(
      entry["metadata"]["expression"])))
  obs, reward, done, info = env.step(call)
  assert not done and reward == 0.0
  assert obs == ours.template.format_tool_result(str(entry["answer"]))
  assert obs.startswith("\n<|im_start|>tool\n")
  _, reward, done, _ = env.step(str(entry["answer"]) + "<|im_end|>")
  assert done and reward == 1.0


def test_template_rejects_a_rewriting_template():
  bad = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] | lower }}"
         "<e>{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
  with pytest.raises(hf_tokenizer.TemplateError):
    jinja_template.template_from_jinja(bad, ["<e>"])
