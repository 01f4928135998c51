"""Loss test inputs shared by test_losses.py and test_loss_registry.py."""

import jax
import numpy as np


def grad_of(fn, logp, *args, **kwargs):
  """d fn(logp, ...)[0] / d logp."""
  return jax.grad(lambda x: fn(x, *args, **kwargs)[0])(logp)


# Ratios r = π_θ/π_denominator chosen away from every band edge used below:
# PPO (0.8, 1.2), clip-higher (0.8, 1.28), DIS (0.7, 6.0), dual clip c=3.
RATIOS = np.array([
    [0.5, 0.75, 0.95, 1.1, 1.5, 4.0, 7.0, 0.5, 0.95, 1.5],
    [7.0, 7.0, 0.75, 1.1, 0.5, 1.5, 0.95, 2.0, 1.0, 1.0],
])
ADV = np.array([
    [1.3, 1.3, 1.3, 1.3, 1.3, -0.7, -0.7, -0.7, -0.7, -0.7],
    [1.1, -0.6, -0.9, -1.2, 0.8, -0.4, 0.5, 1.7, 2.0, -3.0],
])
MASK = np.array([
    [1, 1, 1, 1, 1, 1, 1, 1, 0, 1],
    [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
], np.float32)


def fixed_inputs(seed=0):
  rng = np.random.default_rng(seed)
  denom = -np.abs(rng.normal(1.0, 0.5, RATIOS.shape)) - 0.1
  logp = denom + np.log(RATIOS)
  return (logp.astype(np.float32), denom.astype(np.float32),
          ADV.astype(np.float32), MASK)
