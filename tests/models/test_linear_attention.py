"""Gated DeltaNet kernels (models/layers/linear_attention.py) against
transformers' torch references (Qwen3.5's), float32: the chunked and the
recurrent gated delta rule, with grouped value heads, a length that is no
multiple of the chunk and a carried state, the causal conv with its
decode state, and the GatedDeltaNet layer against Qwen3_5GatedDeltaNet on a
left-padded batch."""

import jax
import numpy as np
import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import linear_attention as la

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
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


def _gdn_pair():
  """Transformers' Qwen3.5 GatedDeltaNet with random weights, and ours with
  the same weights (their fused in_proj_qkv / conv1d rows split by part)."""
  hf_cfg = transformers.Qwen3_5TextConfig(
      hidden_size=32, linear_num_key_heads=HK, linear_num_value_heads=HV,
      linear_key_head_dim=DK, linear_value_head_dim=DV,
      linear_conv_kernel_dim=4, num_hidden_layers=2, rms_norm_eps=1e-6,
      layer_types=["linear_attention", "full_attention"])
  torch.manual_seed(0)
  theirs = ref.Qwen3_5GatedDeltaNet(hf_cfg, 0).eval()
  with torch.no_grad():
    for p in theirs.parameters():
      p.copy_(0.3 * torch.randn_like(p))
  w = {n: p.detach().numpy() for n, p in theirs.named_parameters()}
  kd, vd = HK * DK, HV * DV
  qkv, conv = w["in_proj_qkv.weight"], w["conv1d.weight"][:, 0]
  rows = {"q": (0, kd, HK, DK), "k": (kd, 2 * kd, HK, DK),
          "v": (2 * kd, 2 * kd + vd, HV, DV)}
  params = {f"{n}_proj": qkv[a:b].T.reshape(32, h, dh)
            for n, (a, b, h, dh) in rows.items()}
  params |= {f"{n}_conv": conv[a:b].reshape(h, dh, -1)
             for n, (a, b, h, dh) in rows.items()}
  params |= {"z_proj": w["in_proj_z.weight"].T.reshape(32, HV, DV),
             "b_proj": w["in_proj_b.weight"].T,
             "a_proj": w["in_proj_a.weight"].T, "dt_bias": w["dt_bias"],
             "A_log": w["A_log"], "norm_scale": w["norm.weight"],
             "o_proj": w["out_proj.weight"].T.reshape(HV, DV, 32)}
  ours = la.GatedDeltaNet(
      ModelConfig.tiny(hidden_size=32, rms_norm_eps=1e-6),
      la.LinearAttentionDims(HK, HV, DK, DV, 4), chunk=CHUNK)
  return theirs, ours, params


def test_gated_delta_net_layer_matches_transformers_on_a_left_padded_batch():
  theirs, ours, params = _gdn_pair()
  rng = np.random.default_rng(4)
  x = rng.standard_normal((3, 21, 32)).astype(np.float32)
  mask = np.arange(21)[None] >= np.array([0, 5, 12])[:, None]
  with torch.no_grad():
    want = theirs(torch.from_numpy(x),
                  attention_mask=torch.from_numpy(mask.astype(np.int64)))
  apply = jax.jit(ours.apply)
  got, _ = apply({"params": params}, x, mask)
  got, want = np.asarray(got), want.numpy()
  assert np.abs(got[mask] - want[mask]).max() <= 1e-5
  assert np.abs(want[mask]).max() > 0.1
  # A left-padded row's outputs are those of its real tokens alone.
  alone, _ = apply({"params": params}, x[1:2, 5:], mask[1:2, 5:])
  np.testing.assert_allclose(np.asarray(alone)[0], got[1, 5:], atol=1e-5)
  # Prefill then one-token steps, the state carried: the same outputs.
  out, state = apply({"params": params}, x[:, :15], mask[:, :15])
  outs = [out]
  for t in range(15, 21):
    out, state = apply({"params": params}, x[:, t:t + 1], mask[:, t:t + 1],
                       state)
    outs.append(out)
  np.testing.assert_allclose(np.concatenate(outs, axis=1)[mask], got[mask],
                             atol=1e-5)


def test_chunked_gradients_equal_the_recurrent_ones():
  """The training path's gradients (the chunked form's: UT solve, chunk
  scan) are the token-by-token rule's, for every input and the state."""
  x = {n: jax.numpy.asarray(a) for n, a in _inputs(seed=3).items()}
  state = jax.numpy.asarray(np.random.default_rng(4).standard_normal(
      (B, HV, DK, DV)).astype(np.float32) * 0.1)
  w = np.random.default_rng(5).standard_normal((B, T, HV, DV)).astype(
      np.float32)

  def loss(fn, x, state):
    out, s = fn(**x, state=state)
    return (out * w).sum() + (s * s).sum()
  chunked = lambda **kw: la.chunked_gated_delta_rule(**kw, chunk=CHUNK)
  grad = lambda fn: jax.jit(jax.grad(lambda x, s: loss(fn, x, s),
                                     argnums=(0, 1)))(x, state)
  (got_x, got_s), (want_x, want_s) = (grad(chunked),
                                      grad(la.recurrent_gated_delta_rule))
  for name in x:
    np.testing.assert_allclose(got_x[name], want_x[name], atol=1e-4,
                               rtol=1e-4, err_msg=name)
    assert np.abs(want_x[name]).max() > 1e-2, name
  np.testing.assert_allclose(got_s, want_s, atol=1e-4, rtol=1e-4)


def _grad_temp_mib(t: int) -> float:
  """Compile-only temp memory of the chunked rule's gradient at t tokens."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, np.float32)
  args = dict(q=shape(1, t, 2, 32), k=shape(1, t, 2, 32),
              v=shape(1, t, 4, 32), g=shape(1, t, 4), beta=shape(1, t, 4))
  fn = jax.jit(jax.grad(lambda *a: la.chunked_gated_delta_rule(
      *a, chunk=64)[0].sum(), argnums=(0, 1, 2, 3, 4)))
  mem = fn.lower(*args.values()).compile().memory_analysis()
  return mem.temp_size_in_bytes / 2**20


def test_chunked_gradient_memory_is_linear_in_tokens():
  """Training memory grows with T x chunk, not T^2: 4x tokens, < 5x temp
  (a [T, T] score matrix would be 16x)."""
  small, large = _grad_temp_mib(1024), _grad_temp_mib(4096)
  assert 3 < large / small < 5, (small, large)


def test_unit_lower_solve_is_xlas_triangular_solve_and_cpu_runs_no_trsm():
  """The UT transform's solve (unit_lower_solve) and its gradients equal
  lax.linalg.triangular_solve's; on CPU it is forward substitution, with no
  LAPACK trsm call (jaxlib 0.10.2's batched trsm waits on the thread pool it
  runs on: two at once on a 2-core machine hung a SAO step for good), while
  TPU programs keep XLA's triangular solve."""
  rng = np.random.default_rng(6)
  a = jax.numpy.asarray(rng.standard_normal((2, 3, 64, 64)) * 0.2,
                        dtype=np.float32)
  b = jax.numpy.asarray(rng.standard_normal((2, 3, 64, 24)), dtype=np.float32)
  w = rng.standard_normal(b.shape).astype(np.float32)
  xla = lambda a, b: jax.lax.linalg.triangular_solve(
      a, b, left_side=True, lower=True, unit_diagonal=True)
  loss = lambda solve: jax.jit(jax.value_and_grad(
      lambda a, b: (solve(a, b) * w).sum(), argnums=(0, 1)))
  (got, (got_a, got_b)), (want, (want_a, want_b)) = (
      loss(la.unit_lower_solve)(a, b), loss(xla)(a, b))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  np.testing.assert_allclose(la.unit_lower_solve(a, b), xla(a, b),
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got_a, want_a, atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(got_b, want_b, atol=1e-5, rtol=1e-5)
  assert np.abs(np.tril(want_a, -1)).max() > 1.0
  assert np.abs(np.triu(np.asarray(got_a))).max() == 0  # Strictly lower.

  x = _inputs(seed=7)
  step = jax.jit(jax.grad(lambda q: la.chunked_gated_delta_rule(
      q, x["k"], x["v"], x["g"], x["beta"], chunk=CHUNK)[0].sum()))
  cpu = step.lower(x["q"]).as_text()
  assert "trsm" not in cpu and "triangular_solve" not in cpu
  tpu = step.trace(x["q"]).lower(lowering_platforms=("tpu",)).as_text()
  assert "stablehlo.triangular_solve" in tpu
