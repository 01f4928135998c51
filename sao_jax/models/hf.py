"""HF checkpoint import/export (every family of models/families/) as safetensors.

`load_hf_checkpoint` streams a `config.json` + `*.safetensors` directory (single
file or sharded with `model.safetensors.index.json`) tensor by tensor into the
`Transformer` parameter tree (see `transformer.py` for the layout), placing each
tensor on its sharding as it is read. `save_hf_checkpoint` writes the inverse,
loadable by `transformers.AutoModelForCausalLM.from_pretrained`.

The tensor names and reshapes are `hf_layout.entries` (the family's own names
where they differ). RoPE uses the HF `rotate_half` layout, so no q/k
permutation is needed. With `ModelConfig.scan_layers` the L per-layer HF
tensors of one parameter form one stacked [L, ...] leaf of `decoder/layers/...`
(docs/design/models.md "Layer layout"); the reader and writer go parameter by
parameter, so the host holds one stacked leaf at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Iterator

from absl import logging
import flax.linen as nn
import jax
import numpy as np
import safetensors
import safetensors.numpy

from sao_jax.models import hf_layout
from sao_jax.models import layout
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import UnsupportedConfigError
from sao_jax.models.families import registry

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some exporters add that carry no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
  """A HF checkpoint directory cannot be read or written as this model."""


def _read_config(path: str) -> tuple[dict[str, Any], ModelConfig]:
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise CheckpointError(
        f"{config_path} not found: a HF checkpoint directory needs a "
        f"{CONFIG_FILE} next to its *.safetensors files.")
  with open(config_path) as f:
    try:
      hf_config = json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{config_path} is not valid JSON: {e}") from e
  quant = hf_config.get("quantization_config")
  if quant:
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    raise CheckpointError(
        f"{config_path}: the checkpoint is quantized (quantization_config "
        f"quant_method={method!r}); only float32 / bfloat16 / float16 "
        "safetensors load. Dequantize it first (for DeepSeek-V3's FP8 "
        "weights, DeepSeek's fp8_cast_bf16.py) and drop quantization_config.")
  try:
    return hf_config, ModelConfig.from_hf_config(hf_config)
  except UnsupportedConfigError as e:
    raise CheckpointError(f"{config_path}: {e}") from e
  except KeyError as e:
    raise CheckpointError(f"{config_path} lacks required key {e}.") from e


def _safe_open(file: str):
  """``safetensors.safe_open`` whose errors name the file."""
  try:
    return safetensors.safe_open(file, framework="numpy")
  except Exception as e:  # SafetensorError, OSError: truncated, not a file.
    raise CheckpointError(
        f"{file}: cannot read it as safetensors ({type(e).__name__}: {e}); "
        "re-download or re-convert the checkpoint.") from e


def _read_tensor(handle, name: str, file: str,
                 rows: tuple[int, int] | None = None) -> np.ndarray:
  """One tensor (its `rows` [start, stop) only: a part of a fused tensor);
  errors (a truncated file) and NaN/Inf values name the file."""
  try:
    x = handle.get_tensor(name) if rows is None else (
        handle.get_slice(name)[rows[0]:rows[1]])
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(
        f"{file}: cannot read tensor {name!r} ({type(e).__name__}: {e}); the "
        "file is truncated or corrupt.") from e
  if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
    raise CheckpointError(
        f"{file}: tensor {name!r} holds {int((~np.isfinite(x)).sum())} "
        "NaN/Inf values; the checkpoint is broken.")
  return x


def _index_weight_map(index_path: str) -> dict[str, str]:
  try:
    with open(index_path) as f:
      index = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{index_path} is not a readable JSON index "
                          f"({type(e).__name__}: {e}).") from e
  weight_map = index.get("weight_map") if isinstance(index, dict) else None
  if not weight_map or not isinstance(weight_map, dict):
    raise CheckpointError(f"{index_path} has no 'weight_map' object.")
  return weight_map


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file holding it (inside ``path`` only)."""
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index_path):
    weight_map = _index_weight_map(index_path)
    root = os.path.realpath(path)
    out = {}
    for name, file in weight_map.items():
      full = os.path.join(path, str(file))
      if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise CheckpointError(
            f"{index_path} maps tensor {name!r} to {file!r}, outside the "
            f"checkpoint directory {path}; refusing to read it.")
      if not os.path.isfile(full):
        raise CheckpointError(
            f"{index_path} maps tensor {name!r} to {full}, which does not "
            "exist (incomplete download?).")
      out[name] = full
    return out
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not files:
    raise CheckpointError(
        f"No *.safetensors files (and no {INDEX_FILE}) in {path}; only "
        "safetensors checkpoints are supported (convert .bin/.pt first).")
  out = {}
  for file in files:
    full = os.path.join(path, file)
    with _safe_open(full) as f:
      for name in f.keys():
        out[name] = full
  return out


def _get(tree: Any, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def load_hf_checkpoint(
    path: str | os.PathLike[str],
    *,
    shardings: Any = None,
    param_dtype: str = "float32",
    scan_layers: bool = True,
) -> tuple[ModelConfig, dict[str, Any]]:
  """Reads a HF safetensors checkpoint of a supported family.

  Tensors are read one at a time (memory-mapped by safetensors), converted to
  our layout and `param_dtype`, and placed with `jax.device_put(x, sharding)`.

  Args:
    path: Directory with config.json and *.safetensors (optionally sharded with
      model.safetensors.index.json).
    shardings: None (default device), one `jax.sharding.Sharding` for every
      tensor, or a pytree of shardings with the structure of the returned params
      (e.g. from `nn.logical_to_mesh_sharding`).
    param_dtype: dtype to store parameters in (bf16 checkpoints are upcast to
      float32 by default).
    scan_layers: the layer layout to build (`ModelConfig.scan_layers`):
      stacked `decoder/layers` leaves, or one `decoder/layers_{i}` per layer.

  Returns:
    (config, params): params is the `Transformer` `variables['params']` dict,
    with plain (unboxed) arrays.

  Raises:
    CheckpointError: missing config.json / safetensors files, unsupported
      architecture, missing, unexpected or wrongly shaped tensors.
  """
  path = os.fspath(path)
  hf_config, config = _read_config(path)
  config = dataclasses.replace(config, param_dtype=param_dtype,
                               scan_layers=scan_layers)
  files = _tensor_files(path)
  family = registry.of_hf_config(hf_config)
  entries = hf_layout.entries(config, family.architecture)

  expected = {e.hf_name for e in entries}
  skipped = family.skipped(hf_config) if family.skipped else ()
  skip = {n for n in files if skipped and n.startswith(skipped)}
  if skip:
    logging.info("Skipping %d tensors under %s (not part of the model).",
                 len(skip), skipped)
  unexpected = sorted(
      n for n in files
      if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
      and n not in skip
      and not (config.tie_embeddings and n == "lm_head.weight"))
  if unexpected:
    more = "..." if len(unexpected) > 5 else ""
    raise CheckpointError(
        f"{path}: tensors {unexpected[:5]}{more}"
        f" (in {files[unexpected[0]]}) are not part of a {config.num_layers}-"
        "layer model as described by config.json; is config.json from a "
        "different model?")

  if isinstance(shardings, dict) and "params" in shardings and (
      "decoder" not in shardings):
    shardings = shardings["params"]
  dtype = config.params_dtype
  params: dict[str, Any] = {}
  with contextlib.ExitStack() as stack:
    handles = {}

    def read(e: hf_layout.Entry) -> np.ndarray:
      if e.hf_name not in files:
        raise CheckpointError(
            f"Tensor {e.hf_name!r} is missing from the checkpoint in {path} "
            f"(files: {sorted(set(map(os.path.basename, files.values())))}).")
      file = files[e.hf_name]
      if file not in handles:
        handles[file] = stack.enter_context(_safe_open(file))
      shape = tuple(handles[file].get_slice(e.hf_name).get_shape())
      if shape != e.hf_shape:
        raise CheckpointError(
            f"Tensor {e.hf_name!r} in {file} has shape {shape}, expected "
            f"{e.hf_shape} from config.json.")
      # e.part: rows of a fused tensor (Phi-3's qkv_proj, gate_up_proj),
      # of each of its row blocks if it has several (Qwen3-Next's).
      x = _read_tensor(handles[file], e.hf_name, file,
                       e.part if e.groups == 1 else None)
      if e.groups > 1:
        x = hf_layout.take_part(e, x)
      return e.to_ours(x).astype(dtype)

    for group in hf_layout.groups(entries):
      e = group[0]
      x = hf_layout.stacked(group, [read(g) for g in group])
      if shardings is None:
        sharding = None
      elif isinstance(shardings, jax.sharding.Sharding):
        sharding = shardings
      else:
        try:
          sharding = _get(shardings, e.path)
        except (KeyError, TypeError) as err:
          raise CheckpointError(
              f"`shardings` has no entry for parameter {'/'.join(e.path)} "
              f"(tensor {e.hf_name!r}).") from err
      _set(params, e.path, jax.device_put(np.ascontiguousarray(x), sharding))
  logging.info("Loaded %d tensors (%s params) from %s.", len(entries),
               f"{config.num_params():,}", path)
  return config, params


def _iter_hf_tensors(config: ModelConfig, params: Any, arch: str
                     ) -> Iterator[tuple[hf_layout.Entry, np.ndarray]]:
  if "params" in params and "decoder" not in params:
    params = params["params"]
  params = nn.unbox(params)
  # The params' own layout wins over config.scan_layers (either is exported).
  config = dataclasses.replace(
      config, scan_layers="per_layer" not in layout.layouts(params))
  for group in hf_layout.groups(hf_layout.entries(config, arch)):
    e = group[0]
    try:
      whole = np.asarray(jax.device_get(_get(params, e.path)))
    except KeyError as err:
      raise CheckpointError(
          f"params lack {'/'.join(e.path)} (for HF tensor {e.hf_name!r}); do "
          "they belong to this config?") from err
    lead = hf_layout.stacked(group, [np.zeros(())] * len(group)).shape
    if whole.shape[:len(lead)] != lead:
      raise CheckpointError(
          f"Parameter {'/'.join(e.path)} has shape {whole.shape}; this config "
          f"expects a leading axis of {lead[0]}"
          + (f", then {lead[1]}" if len(lead) > 1 else "")
          + " (layers of the stacked stage, then experts).")
    for e in group:
      x = whole
      for index in (e.layer, e.expert):
        x = x if index is None else x[index]
      x = np.ascontiguousarray(e.to_hf(x))
      want = e.hf_shape if e.part is None else (
          (e.groups * (e.part[1] - e.part[0]),) + e.hf_shape[1:])
      if x.shape != want:
        raise CheckpointError(
            f"Parameter {'/'.join(e.path)} gives {e.hf_name!r} of shape "
            f"{x.shape}, expected {want}.")
      yield e, x


def _hf_tensors(config: ModelConfig, params: Any,
                arch: str) -> dict[str, np.ndarray]:
  """HF name -> tensor; a fused tensor's parts concatenated in row order."""
  out, parts = {}, {}
  for e, x in _iter_hf_tensors(config, params, arch):
    if e.part is None:
      out[e.hf_name] = x
    else:
      parts.setdefault(e.hf_name, []).append((e, x))
      out[e.hf_name] = None  # Keeps the tensors' order.
  for name, xs in parts.items():
    out[name] = hf_layout.join_parts(xs)
  return out


def hf_tensors(config: ModelConfig, params: Any,
               arch: str | None = None) -> dict[str, np.ndarray]:
  """HF name -> host tensor of ``params``, by the family's export mapping
  (what `save_hf_checkpoint` writes; a rollout engine's weight push)."""
  return _hf_tensors(config, params, arch or config.hf_architecture())


def save_hf_checkpoint(
    config: ModelConfig,
    params: Any,
    path: str | os.PathLike[str],
    arch: str | None = None,
) -> None:
  """Writes config.json + model.safetensors loadable by transformers.

  Args:
    config: the model config.
    params: `Transformer` params (`variables['params']` or the whole variables
      dict; boxed or plain; any sharding: gathered to host per tensor).
    path: output directory (created).
    arch: a `SUPPORTED_ARCHITECTURES` entry that can express `config`
      (e.g. 'Qwen2ForCausalLM' needs qkv_bias=True); None: the config's own
      (`ModelConfig.hf_architecture`).
  """
  path = os.fspath(path)
  arch = arch or config.hf_architecture()
  try:
    hf_config = config.to_hf_config(arch)
  except UnsupportedConfigError as e:
    raise CheckpointError(str(e)) from e
  tensors = _hf_tensors(config, params, arch)
  dtypes = {str(x.dtype) for x in tensors.values()}
  if len(dtypes) == 1:
    hf_config["dtype"] = hf_config["torch_dtype"] = dtypes.pop()
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  safetensors.numpy.save_file(tensors, os.path.join(path, WEIGHTS_FILE),
                              metadata={"format": "pt"})
  logging.info("Wrote %s checkpoint (%d tensors) to %s.", arch, len(tensors),
               path)
