"""The trainer's view of sampled trajectories: their tokens as one padded
batch, and the trainer's per-token log-probs of them (what a sampler's
`rollout_logp` is compared with)."""

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from sao_jax.models.logprobs import token_logprobs


def padded(trajs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
  """Tokens int32 [N, T_max] (zero after each trajectory) and the mask of
  real tokens, bool [N, T_max]."""
  t_max = max(t.length for t in trajs)
  toks = np.zeros((len(trajs), t_max), np.int32)
  mask = np.zeros((len(trajs), t_max), bool)
  for i, t in enumerate(trajs):
    toks[i, :t.length], mask[i, :t.length] = t.tokens, True
  return toks, mask


def trainer_logp(trajs: Sequence[Any], cfg: Any, params: Any,
                 temperature: float) -> np.ndarray:
  """`token_logprobs` of the padded trajectories under `params`, float
  [N, T_max]."""
  toks, mask = padded(trajs)
  return np.asarray(token_logprobs(params, cfg, jnp.asarray(toks),
                                   jnp.asarray(mask), temperature))
