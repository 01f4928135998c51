"""Tiny HF tokenizer directories of current model families, built offline.

Each directory holds a byte-level BPE `tokenizer.json` trained here with the
`tokenizers` library on a few sentences (so any text round-trips), the
family's special tokens as added tokens, a `tokenizer_config.json` naming
them, and the family's real chat template (tests/fixtures/chat_templates/).
transformers' `AutoTokenizer` loads the same directory as the reference.
"""

import json
import pathlib

from tokenizers import Tokenizer
from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import trainers

TEMPLATES = pathlib.Path(__file__).resolve().parent / "fixtures" / "chat_templates"

# family -> (template file, added tokens, tokenizer_config special tokens).
FAMILIES = {
    "qwen3": ("qwen3.jinja",
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
               "</tool_call>", "<tool_response>", "</tool_response>",
               "<think>", "</think>"],
              {"bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>"}),
    "gemma3": ("gemma3.jinja",
               ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                "<end_of_turn>", "<start_of_image>"],
               {"bos_token": "<bos>", "eos_token": "<eos>",
                "pad_token": "<pad>", "unk_token": "<unk>"}),
    "llama3": ("llama3_2.jinja",
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"],
               {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}

_CORPUS = [
    "What is 12 + 7? The answer is 19.", "Compute 3 * (4 - 1) = 9",
    "You are a helpful assistant. Think step by step.",
    '{"name": "calculator", "arguments": {"expression": "12 + 7"}}',
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
    "user model assistant system tool ipython functions JSON",
]


def build(family: str, out_dir: pathlib.Path) -> pathlib.Path:
  """Writes the tiny tokenizer directory of `family` into `out_dir`."""
  template_file, added, specials = FAMILIES[family]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=added, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  out_dir.mkdir(parents=True, exist_ok=True)
  tok.save(str(out_dir / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": (TEMPLATES / template_file).read_text("utf-8"),
            **specials}
  (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
  return out_dir
