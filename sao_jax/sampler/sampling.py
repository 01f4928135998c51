"""Next-token sampling in float32: temperature, top-k, top-p (nucleus), greedy.

Which log-probability is recorded (the contract with the trainer): for every
sampled token we return `log_softmax(logits / temperature)[token]` over the
*full* vocabulary, in float32 -- exactly what the trainer computes with
`sao_jax.models.logprobs.token_logprobs` at the same temperature, so the SAO
ratio r_t = exp(logp_t - rollout_logp_t) (docs/design/math.md "Equations",
Eq. 1) is exact on-policy. With top-p = 1 and top-k = 0 (the default) this *is*
the distribution the token was drawn from. With truncation (top-p < 1 or
top-k > 0) the token is drawn from the renormalised truncated distribution; its
log-probability there equals the returned value minus log(kept mass).
`SamplingParams.truncated_logprobs=True` returns that truncated log-probability
instead. Greedy decoding returns the temperature-1 log-probability of the
argmax.

Sampling uses the inverse CDF with one uniform per row (not Gumbel-max over the
vocabulary): one random number per row instead of V, which matters on CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sao_jax import ranges

Array = jax.Array
_NEG_INF = -jnp.inf
# The allowed value of each `SamplingParams` field (`ranges`; temperature
# unless greedy); config_validation checks sampler.<field> with them.
FIELD_RULES = {
    "temperature": ranges.GT0,
    "top_p": ranges.Rule(lambda v: 0 < v <= 1, "float in (0, 1]"),
    "top_k": ranges.Rule(lambda v: v >= 0, "int >= 0 (0 disables top-k)"),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How next tokens are chosen (hashable: a static argument of jitted code).

  Attributes:
    temperature: Logits are divided by it before softmax; must be > 0.
    top_p: Nucleus mass in (0, 1]; 1 disables it.
    top_k: Keep the k most likely tokens; 0 disables it.
    greedy: Take the argmax (temperature/top-p/top-k then only affect nothing
      but the recorded log-prob, which uses temperature 1).
    truncated_logprobs: Record log-probs under the truncated (top-p/top-k)
      distribution instead of the full temperature-scaled one (module doc).
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  greedy: bool = False
  truncated_logprobs: bool = False

  def __post_init__(self):
    ranges.check_fields(self, {k: rule for k, rule in FIELD_RULES.items()
                               if not (self.greedy and k == "temperature")})

  @property
  def truncates(self) -> bool:
    return not self.greedy and (self.top_p < 1.0 or self.top_k > 0)


def scaled_log_softmax(logits: Array, temperature: float) -> Array:
  """log_softmax(logits / temperature) in float32 over the last axis."""
  return jax.nn.log_softmax(
      logits.astype(jnp.float32) / jnp.float32(temperature), axis=-1)


def truncate_logits(logits: Array, top_p: float = 1.0, top_k: int = 0) -> Array:
  """Sets logits outside top-k / the top-p nucleus to -inf (float32, [..., V]).

  The nucleus is the smallest set of most likely tokens whose mass reaches
  top_p (the token that crosses the threshold is kept). Ties at the top-k
  threshold are all kept.
  """
  logits = logits.astype(jnp.float32)
  if top_k <= 0 and top_p >= 1.0:
    return logits
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # Descending.
  keep = jnp.ones_like(logits, dtype=jnp.bool_)
  if top_k > 0:
    k = min(top_k, logits.shape[-1])
    keep &= logits >= sorted_logits[..., k - 1:k]
  if top_p < 1.0:
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Smallest sorted logit whose preceding mass is still < top_p.
    n_keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)
    keep &= logits >= threshold
  return jnp.where(keep, logits, _NEG_INF)


def sample(rng: Array, logits: Array,
           params: SamplingParams) -> tuple[Array, Array]:
  """Draws one token per row; returns (tokens int32[B], logprobs float32[B]).

  Args:
    rng: PRNG key, or uint32 [B, 2] keys, one per row (each row's draw then
      depends on its own key only, not on the rest of the batch).
    logits: float [B, V] next-token logits.
    params: Sampling parameters (module doc says which log-prob is returned).
  """
  logits = logits.astype(jnp.float32)
  if params.greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  scaled = logits / jnp.float32(params.temperature)
  full_logp = jax.nn.log_softmax(scaled, axis=-1)
  draw_logp = full_logp
  if params.truncates:
    draw_logp = jax.nn.log_softmax(
        truncate_logits(scaled, params.top_p, params.top_k), axis=-1)
  # Inverse CDF: first index whose cumulative mass exceeds u * total mass.
  cdf = jnp.cumsum(jnp.exp(draw_logp), axis=-1)
  if rng.ndim == 2:
    u = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(rng)
  else:
    u = jax.random.uniform(rng, (logits.shape[0], 1), jnp.float32)
  tokens = jnp.sum(cdf <= u * cdf[:, -1:], axis=-1)
  tokens = jnp.minimum(tokens, logits.shape[-1] - 1).astype(jnp.int32)
  out_logp = draw_logp if params.truncated_logprobs else full_logp
  return tokens, jnp.take_along_axis(out_logp, tokens[:, None], axis=-1)[:, 0]
