"""Gated DeltaNet kernels (models/layers/linear_attention.py) against
transformers' torch references (Qwen3.5's), float32: the chunked and the
recurrent gated delta rule, with grouped value heads, a length that is no
multiple of the chunk and a carried state, and the causal conv with its
decode state."""

import jax
import numpy as np
import pytest

from sao_jax.models.layers import linear_attention as la

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.ref

B, T, HK, HV, DK, DV, CHUNK = 2, 37, 2, 4, 8, 16, 16


def _inputs(seed: int = 0, t: int = T) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  return dict(q=f(B, t, HK, DK), k=f(B, t, HK, DK), v=f(B, t, HV, DV),
              g=-np.exp(f(B, t, HV)) * 0.3,  # log decays < 0.
              beta=1 / (1 + np.exp(-f(B, t, HV))))


def _torch(fn, x, state=None, **kw):
  args = {n: torch.from_numpy(a) for n, a in x.items()}
  out, s = fn(args["q"], args["k"], args["v"], g=args["g"], beta=args["beta"],
              initial_state=None if state is None else torch.from_numpy(state),
              output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
  return out.numpy(), s.numpy()


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_gated_delta_rule_matches_transformers(form):
  x = _inputs()
  state = np.random.default_rng(1).standard_normal(
      (B, HV, DK, DV)).astype(np.float32) * 0.1
  want, want_state = _torch(ref.torch_chunk_gated_delta_rule, x, state,
                            chunk_size=CHUNK)
  slow, slow_state = _torch(ref.torch_recurrent_gated_delta_rule, x, state)
  np.testing.assert_allclose(slow, want, atol=2e-5)  # The two references.
  if form == "chunked":
    got, got_state = jax.jit(la.chunked_gated_delta_rule,
                             static_argnames="chunk")(**x, state=state,
                                                      chunk=CHUNK)
  else:
    got, got_state = jax.jit(la.recurrent_gated_delta_rule)(**x, state=state)
  assert np.abs(np.asarray(got) - want).max() <= 1e-5
  assert np.abs(np.asarray(got_state) - want_state).max() <= 1e-5
  assert np.abs(want).max() > 0.1 and np.abs(want_state).max() > 0.1


def test_prefill_state_then_decode_steps_equal_one_pass():
  """A chunked prefill's state carried into token-by-token decode gives the
  outputs of one pass over the whole sequence (generation = training)."""
  x = _inputs(seed=2)
  prefill = jax.jit(la.chunked_gated_delta_rule, static_argnames="chunk")
  whole, whole_state = prefill(**x, chunk=CHUNK)
  split = 29
  head = {n: a[:, :split] for n, a in x.items()}
  out, state = prefill(**head, chunk=CHUNK)
  outs = [out]
  decode = jax.jit(la.recurrent_gated_delta_rule)  # One compile, 8 steps.
  for t in range(split, T):
    step = {n: a[:, t:t + 1] for n, a in x.items()}
    out, state = decode(**step, state=state)
    outs.append(out)
  got = np.concatenate([np.asarray(o) for o in outs], axis=1)
  np.testing.assert_allclose(got, np.asarray(whole), atol=1e-5)
  np.testing.assert_allclose(np.asarray(state), np.asarray(whole_state),
                             atol=1e-5)


def test_causal_conv_matches_transformers_and_carries_its_state():
  rng = np.random.default_rng(3)
  c, kernel = 12, 4
  x = rng.standard_normal((B, T, c)).astype(np.float32)
  w = rng.standard_normal((c, kernel)).astype(np.float32)
  want = ref.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2),
                              torch.from_numpy(w), None,
                              activation="silu").transpose(1, 2).numpy()
  got, state = la.causal_conv1d(x, w)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(state),
                                np.swapaxes(x[:, -(kernel - 1):], 1, 2))
  # Decode: a prefix then one token at a time, as transformers' update.
  out, state = la.causal_conv1d(x[:, :30], w)
  conv_state = torch.from_numpy(np.array(state))
  for t in range(30, T):
    out, state = la.causal_conv1d(x[:, t:t + 1], w, state)
    theirs = ref.causal_conv1d_update(
        torch.from_numpy(x[:, t:t + 1]).transpose(1, 2), conv_state,
        torch.from_numpy(w), None, "silu").transpose(1, 2).numpy()
    np.testing.assert_allclose(np.asarray(out), want[:, t:t + 1], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), theirs, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state), conv_state.numpy())
