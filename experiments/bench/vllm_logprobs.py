r"""vLLM's sampled-token log-probs vs our trainer's forward on the same tokens.

The cross-engine mismatch that DIS exists for (issue 37 item 4): SmolLM2
(the converted checkpoint, `configs/smollm2.default_checkpoint_dir()`)
samples in vLLM (`processed_logprobs`, the engine's settings of
sampler/vllm_engine.py) and our trainer (`models.logprobs.token_logprobs`,
the same dtype) scores the same tokens at the same temperature. Reports per
temperature the mean and max |dlogp| over the sampled tokens and the share
the DIS band would mask at SAO's default epsilon (ratio outside (1 - 0.3,
1 + 5.0)). Needs the `vllm` extra (README "Rollout engines").

  .venv/bin/python experiments/bench/vllm_logprobs.py --dtype=float32
  .venv/bin/python experiments/bench/vllm_logprobs.py --dtype=bfloat16

One JSON line per temperature.
"""

import argparse
import dataclasses
import json
import os

EPS_LOW, EPS_HIGH = 0.3, 5.0  # SAO's default DIS band (rl/losses.py).
PROMPTS = ("What is 12 times 7?", "Name three colours.",
           "Write a haiku about rain.", "Explain gravity to a child.",
           "List the planets.", "What is the capital of France?",
           "Count from one to ten.", "Why is the sky blue?")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", default="")
  parser.add_argument("--dtype", default="float32",
                      choices=("float32", "bfloat16"))
  parser.add_argument("--temperatures", default="1.0,0.8")
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=48)
  args = parser.parse_args()
  os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
  os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
  os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  from tokenizers import Tokenizer
  import vllm
  from vllm.inputs import TokensPrompt

  import loop_setup  # This script's folder: puts the checkout on sys.path.
  from sao_jax.models import hf
  from sao_jax.models.logprobs import token_logprobs
  # pylint: enable=g-import-not-at-top

  path = args.checkpoint or loop_setup.import_config(
      "smollm2").default_checkpoint_dir()
  tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
  prompts = [[1] + tok.encode(PROMPTS[i % len(PROMPTS)]).ids
             for i in range(args.rows)]
  mcfg, params = hf.load_hf_checkpoint(path)
  if args.dtype == "bfloat16":
    mcfg = dataclasses.replace(mcfg, dtype="bfloat16", param_dtype="bfloat16")
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  llm = vllm.LLM(model=path, dtype=args.dtype, skip_tokenizer_init=True,
                 max_model_len=256, logprobs_mode="processed_logprobs",
                 enforce_eager=True, seed=0, max_num_seqs=args.rows)
  for temperature in map(float, args.temperatures.split(",")):
    sampling = vllm.SamplingParams(
        temperature=temperature, max_tokens=args.new_tokens, logprobs=0,
        detokenize=False, ignore_eos=True, seed=3)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        sampling, use_tqdm=False)
    rows = []
    for p, o in zip(prompts, outs):
      c = o.outputs[0]
      rows.append((p, list(c.token_ids),
                   [c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids)]))
    width = max(len(p) + len(a) for p, a, _ in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, (p, a, _) in enumerate(rows):
      tokens[i, :len(p) + len(a)], mask[i, :len(p) + len(a)] = p + a, True
    ours = np.asarray(token_logprobs(params, mcfg, jnp.asarray(tokens),
                                     jnp.asarray(mask), temperature))
    gaps, ratios = [], []
    for i, (p, a, theirs) in enumerate(rows):
      mine = ours[i, len(p):len(p) + len(a)]
      gaps.extend(np.abs(mine - np.asarray(theirs)))
      ratios.extend(np.exp(mine - np.asarray(theirs)))
    gaps, ratios = np.asarray(gaps), np.asarray(ratios)
    masked = (ratios <= 1 - EPS_LOW) | (ratios >= 1 + EPS_HIGH)
    print(json.dumps({
        "dtype": args.dtype, "temperature": temperature,
        "tokens": int(gaps.size), "mean_abs_dlogp": float(gaps.mean()),
        "max_abs_dlogp": float(gaps.max()),
        "dis_masked_frac": float(masked.mean())}), flush=True)


if __name__ == "__main__":
  main()
