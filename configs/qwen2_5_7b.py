r"""Qwen2.5-7B-Instruct at real size, for checking against TPU slices (shapes).

The architecture of Qwen2.5-7B-Instruct (its config.json; ``models/hf.py``
loads the checkpoint with ``--config.model.init_from=DIR``); ``8k`` or
``32k`` context, bfloat16 compute over float32 master weights with remat,
the state FSDP-sharded over the trainer's 16 chips of a v5p-64 (one row of
the batch each) and two chips of each host for the sampler (``sampler.chips``). Check it before renting the slice:

  python -m sao_jax.aot --config=configs/qwen2_5_7b.py:8k --topology=v5p-64

What fits where is in BENCHMARKS.md ("TPU slices on paper"): at 8k the whole
run fits a v5p-64 (and a v5p-32; not a v5p-16); at 32k it fits a v5p-64 too
(35.6 GiB a chip for the SAO step).
"""

import ml_collections

from configs import base

CONTEXTS = {"8k": 8192, "32k": 32768}


def get_config(context: str = "8k") -> ml_collections.ConfigDict:
  """The run at ``context`` tokens per trajectory ('8k' or '32k')."""
  if context not in CONTEXTS:
    raise ValueError(f"context {context!r}: expected one of {list(CONTEXTS)}.")
  length = CONTEXTS[context]
  config = base.get_config()

  m = config.model  # Qwen2.5-7B-Instruct's config.json.
  m.vocab_size = 152064
  m.hidden_size = 3584
  m.intermediate_size = 18944
  m.num_layers = 28
  m.num_heads = 28
  m.num_kv_heads = 4
  m.head_dim = 128
  m.rope_theta = 1000000.0
  m.rms_norm_eps = 1e-6
  m.qkv_bias = True
  m.tie_embeddings = False
  m.param_dtype = "float32"  # Master weights and AdamW moments.

  return v5p_layout(config, length, ring_bytes=256 * 2**20)


def v5p_layout(config: ml_collections.ConfigDict, length: int,
               ring_bytes: int, slice_name: str = "v5p-64"
               ) -> ml_collections.ConfigDict:
  """A run of ``length``-token trajectories on a v5p slice (the real-size
  configs): bfloat16 compute with full remat, the checkpoint's own
  tokenizer, and each host's 4 chips split 0, 1 trainer / 2, 3 sampler.

  The trainer's chips (16 of a v5p-64's 32) hold the state FSDP-sharded,
  one row of the batch each; each host's sampler (tensor parallel over its 2
  chips, sampler.mesh's default with a split) fills its host's share, 2
  episodes.
  """
  chips = int(slice_name.rpartition("-")[2]) // 2  # v5p-N: N TensorCores.
  config.model.dtype = "bfloat16"  # Compute; model.param_dtype the config's.
  config.model.remat_policy = "full"
  config.tokenizer.path = ""  # A run sets the checkpoint's own directory.
  config.tokenizer.vocab_size = 0
  s = config.sampler
  s.max_total_tokens = length
  s.max_new_tokens = length // 2
  s.min_prompt_bucket = 64
  s.batch_size = 2
  s.decode_chunk = 16
  s.chips = f"{slice_name}:2,3"

  config.rl.critic_warmup_steps = 10
  config.rl.critic_updates_per_step = 2
  config.rl.critic_frozen_attention = True

  t = config.train
  t.batch_size = chips // 2  # One row per trainer chip.
  t.max_seq_len = length
  config.mesh.data = 1
  config.mesh.fsdp = -1  # The whole state over every trainer chip.
  config.mesh.tensor = 1
  config.ring.capacity_bytes = ring_bytes
  return config
