"""HF transformers parity and safetensors import/export of Llama / Qwen2.

Reference: tiny random `LlamaForCausalLM` / `Qwen2ForCausalLM` in float32 with
eager attention (tunix `qwen_align_test`, levanter `test_llama_roundtrip`).
"""

import copy
import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import hf
from sao_jax.models import transformer as tm
from sao_jax.models.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position
safetensors_numpy = pytest.importorskip("safetensors.numpy")

pytestmark = pytest.mark.ref

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5,
              attn_implementation="eager")
ARCHS = {
    # Llama: tied embeddings, non-default theta, head_dim != hidden/heads.
    "LlamaForCausalLM": lambda: transformers.LlamaConfig(
        tie_word_embeddings=True, rope_theta=500.0, head_dim=8, **COMMON),
    # Qwen2: q/k/v biases, untied output head.
    "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(
        tie_word_embeddings=False, rope_theta=10000.0, **COMMON),
}


def _batch():
  return hf_reference.left_padded_batch()


_hf_logits = hf_reference.hf_logits


_our_logits = hf_reference.our_logits


@pytest.fixture(scope="module", params=sorted(ARCHS))
def reference(request, tmp_path_factory):
  """(arch, HF model, its saved dir, HF logits) with all weights randomised."""
  arch = request.param
  torch.manual_seed(0)
  model = getattr(transformers, arch)(ARCHS[arch]()).eval()
  with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb all.
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  path = tmp_path_factory.mktemp(arch) / "hf"
  model.save_pretrained(path)
  return arch, model, path, _hf_logits(model, *_batch())


def test_import_matches_hf_logits(reference):
  arch, _, path, want = reference
  config, params = hf.load_hf_checkpoint(path)
  assert config.qkv_bias == (arch == "Qwen2ForCausalLM")
  assert config.tie_embeddings == (arch == "LlamaForCausalLM")
  tokens, mask, positions = _batch()
  got = _our_logits(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  assert np.abs(want[mask]).max() > 0.1  # Real logits, not near zero.
  n = sum(x.size for x in jax.tree.leaves(params))
  assert n == config.num_params()


def test_export_reloads_in_transformers(reference, tmp_path):
  arch, hf_model, path, want = reference
  config, params = hf.load_hf_checkpoint(path)
  hf.save_hf_checkpoint(config, params, tmp_path, arch=arch)
  # Tensor-for-tensor equal to what HF saved (round-tripped bytes).
  theirs = safetensors_numpy.load_file(os.path.join(path, "model.safetensors"))
  ours = safetensors_numpy.load_file(
      os.path.join(tmp_path, "model.safetensors"))
  assert sorted(ours) == sorted(theirs)
  for name in theirs:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == arch
  tokens, mask, positions = _batch()
  got = _hf_logits(reloaded, tokens, mask, positions)
  ref = _our_logits(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - ref[mask]).max() <= 1e-4
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  del hf_model


def test_sharded_checkpoint_bf16_and_shardings(reference, tmp_path):
  arch, hf_model, path, _ = reference
  _, ref_params = hf.load_hf_checkpoint(path)
  # Sharded (index.json + several files), stored in bfloat16.
  copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(
      tmp_path, max_shard_size="40KB")
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  # Place every tensor on a mesh, with shardings from the logical axis names.
  config = ModelConfig.from_hf_config(json.loads(
      (tmp_path / "config.json").read_text()))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  tok = jnp.zeros((1, 2), jnp.int32)
  abstract = jax.eval_shape(tm.Transformer(config).init, jax.random.key(0), tok,
                            tok, tok > 0)
  shardings = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(abstract), mesh, [("embed", "fsdp")])["params"]
  config, params = hf.load_hf_checkpoint(tmp_path, shardings=shardings)
  emb = params["decoder"]["embedder"]["embedding"]
  assert emb.sharding == jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "fsdp"))
  assert emb.dtype == jnp.float32
  # bf16 values upcast exactly: equal to the float32 weights rounded to bf16.
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(b).astype(jnp.bfloat16).astype(np.float32))
  _, bf = hf.load_hf_checkpoint(tmp_path, param_dtype="bfloat16")
  assert bf["decoder"]["final_norm"]["scale"].dtype == jnp.bfloat16


def _copy(path, out):
  shutil.copytree(path, out)
  return out


def _rewrite(path, edit):
  file = os.path.join(path, "model.safetensors")
  tensors = safetensors_numpy.load_file(file)
  edit(tensors)
  safetensors_numpy.save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("reference", ["Qwen2ForCausalLM"], indirect=True)
def test_malformed_checkpoints(reference, tmp_path):
  _, _, path, _ = reference
  name = "model.layers.1.self_attn.k_proj.bias"

  missing = _copy(path, tmp_path / "missing")
  _rewrite(missing, lambda t: t.pop(name))
  with pytest.raises(hf.CheckpointError, match=rf"'{name}' is missing"):
    hf.load_hf_checkpoint(missing)

  shape = _copy(path, tmp_path / "shape")
  _rewrite(shape, lambda t: t.update({name: np.zeros(16, np.float32)}))
  with pytest.raises(hf.CheckpointError) as e:
    hf.load_hf_checkpoint(shape)
  assert name in str(e.value) and "model.safetensors" in str(e.value)
  assert "(16,)" in str(e.value) and "(32,)" in str(e.value)

  extra = _copy(path, tmp_path / "extra")  # E.g. config of a 1-layer model.
  cfg = json.loads((extra / "config.json").read_text())
  (extra / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 1}))
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\..*not part"):
    hf.load_hf_checkpoint(extra)

  arch = _copy(path, tmp_path / "arch")
  (arch / "config.json").write_text(
      json.dumps(cfg | {"architectures": ["Olmo2ForCausalLM"]}))
  with pytest.raises(hf.CheckpointError,
                     match=r"config\.json.*Unsupported architecture.*Olmo2"):
    hf.load_hf_checkpoint(arch)

  no_config = _copy(path, tmp_path / "no_config")
  os.remove(no_config / "config.json")
  with pytest.raises(hf.CheckpointError,
                     match=r"no_config/config\.json not found"):
    hf.load_hf_checkpoint(no_config)

  no_weights = _copy(path, tmp_path / "no_weights")
  os.remove(no_weights / "model.safetensors")
  with pytest.raises(hf.CheckpointError, match=r"No \*\.safetensors files"):
    hf.load_hf_checkpoint(no_weights)

  config, params = hf.load_hf_checkpoint(path)
  with pytest.raises(hf.CheckpointError, match="qkv_bias"):
    hf.save_hf_checkpoint(config, params, tmp_path / "out",
                          arch="LlamaForCausalLM")
