"""Sequence packing: the packed stream, and packed == unpacked numerics.

A packed batch (``sao_jax.data.packing``) holds several trajectories per row;
everything per trajectory must equal the unpacked batch of the same
trajectories (float32, within 1e-5): advantages and value targets of every
estimator, the DIS and value losses and their gradients, and nothing may leak
from one trajectory of a row into another.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import packing_inputs as pi
from sao_jax.data import consumed
from sao_jax.data import stream
from sao_jax.data import trajectory
from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.ipc import ring
from sao_jax.rl import advantages as adv_lib
from sao_jax.rl import losses
from sao_jax.rl import segments
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import step as step_lib

TOL = pi.TOL


# ------------------------------------------------------------- the stream ---


def test_packed_rows_hold_every_trajectory_once_with_restarting_positions():
  trajs = pi.trajs(n=23)
  batches, counters = pi.packed(trajs, batch_size=3, seq_len=32,
                              max_segments=4)
  seen = []
  for batch in batches:
    seg, pos = batch["segment_ids"], batch["positions"]
    assert seg.shape == (3, 32) and batch["length"].shape == (3, 4)
    for b in range(3):
      ids = seg[b][seg[b] > 0]
      assert np.all(np.diff(ids) >= 0) and np.all(seg[b][len(ids):] == 0)
      for s in range(1, ids.max(initial=0) + 1):
        where = seg[b] == s
        np.testing.assert_array_equal(pos[b][where], np.arange(where.sum()))
        traj = trajs[int(batch["prompt_id"][b, s - 1])]
        np.testing.assert_array_equal(batch["tokens"][b][where], traj.tokens)
        np.testing.assert_array_equal(batch["action_mask"][b][where],
                                      traj.action_mask)
        assert batch["length"][b, s - 1] == traj.length
        seen.append(traj.prompt_id)
    np.testing.assert_array_equal(batch["attention_mask"], seg > 0)
    assert np.all(batch["staleness"][batch["length"] == 0] == -1)
  assert sorted(seen) == list(range(23))  # None lost, none twice.
  c = counters.as_dict()
  assert c["pack_held"] == 0
  total = sum(t.length for t in trajs)
  assert c["batch_tokens"] == total
  assert c["batch_slots"] == 3 * 32 * len(batches)
  assert c["padding_frac"] == pytest.approx(1 - total / (96 * len(batches)))
  # The same trajectories unpacked (one a row, T=32) pad far more.
  assert c["padding_frac"] < 1 - total / (23 * 32) - 0.3


def test_slot_group_index_is_dense_over_filled_slots():
  batches, _ = pi.packed(pi.trajs(n=9, groups=3), batch_size=2, seq_len=40,
                       max_segments=5, process_index=1)
  for batch in batches:
    filled = batch["length"] > 0
    gi, gid = batch["group_index"], batch["group_id"]
    assert np.all(gi[~filled] == -1)
    base = 1 * filled.size
    for g in np.unique(gid[filled]):
      assert len(np.unique(gi[filled & (gid == g)])) == 1
    assert sorted(np.unique(gi[filled]) - base) == list(
        range(len(np.unique(gid[filled]))))


def test_held_trajectory_is_rechecked_for_staleness_and_dropped():
  trajs = pi.trajs(n=8, lo=14, hi=14)  # Two fit a row of 30: the rest wait.
  # Rows: [0 1] (2 held), [2 3] (4 held, then dropped), [5 6] (7 held), [7].
  batches, counters = pi.packed(
      trajs, batch_size=1, seq_len=30, max_segments=4,
      restale=lambda t: None if t.prompt_id == 4 else 2)
  staleness = {int(p): int(st) for b in batches for p, n, st in zip(
      b["prompt_id"].ravel(), b["length"].ravel(), b["staleness"].ravel())
               if n > 0}
  assert sorted(staleness) == [0, 1, 2, 3, 5, 6, 7]
  # Held trajectories take their staleness at the batch they enter.
  assert staleness == {0: 1, 1: 1, 2: 2, 3: 1, 5: 1, 6: 1, 7: 2}
  c = counters.as_dict()
  assert (c["dropped_stale"], c["admitted"], c["pack_held"]) == (1, -1, 0)


def test_consumed_meta_leaves_held_episodes_unread():
  tracker = consumed.ConsumedEpisodes()
  for e in range(6):
    tracker._add(e)  # pylint: disable=protected-access
  tracker.hold(3)
  tracker.hold(5)
  assert tracker.to_meta() == {"watermark": 3, "above": [4]}
  resumed = consumed.ConsumedEpisodes(**tracker.to_meta())
  assert [e in resumed for e in range(7)] == [1, 1, 1, 0, 1, 0, 0]
  tracker.release(3)
  tracker.release(5)
  assert tracker.to_meta() == {"watermark": 6, "above": []}


def test_live_packed_stream_accounts_every_episode():
  """Through the ring: each batch's trajectories are exactly the episodes
  the tracker's meta counts consumed once the batch is out."""
  trajs = pi.trajs(n=17, lo=6, hi=12)
  for e, t in enumerate(trajs):
    t.group_id = e  # One rollout per draw: episode e.
  tracker = consumed.ConsumedEpisodes()
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 16) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      for t in trajs:
        w.write(*trajectory.encode(t))
    s = stream.TrajectoryStream(
        r, batch_size=2, seq_len=24, trainer_version=lambda: 7,
        staleness=StalenessPolicy(4), read_timeout=5.0, consumed=tracker,
        pack_segments=3, drop_remainder=False)
    trained = set()
    for batch in s.dataset:
      trained |= {int(g) for g, n in zip(batch["group_id"].ravel(),
                                         batch["length"].ravel()) if n > 0}
      meta = consumed.ConsumedEpisodes(**tracker.to_meta())
      assert {e for e in range(17) if e in meta} == trained
  assert trained == set(range(17))


def test_trajectory_metrics_skip_empty_slots_and_span_per_segment():
  trajs = pi.trajs(n=5)
  trajs[1].policy_version[trajs[1].action_mask > 0] = 9  # Span 0 alone.
  (batch,), _ = pi.packed(trajs, batch_size=1, seq_len=80, max_segments=8)
  st = metrics_lib.trajectory_values(batch, "staleness", np.asarray)
  np.testing.assert_array_equal(st, [1] * 5)
  span = metrics_lib.batch_version_span(batch, np.asarray)
  want = [metrics_lib.version_span(t.policy_version[None],
                                   t.action_mask[None])[0] for t in trajs]
  np.testing.assert_array_equal(span, want)
  # One row of five trajectories of versions 5..6 and 9: the row spans 4.
  assert metrics_lib.version_span(batch["policy_version"],
                                  batch["action_mask"])[0] == 4


# ------------------------------------------------- packed == unpacked math ---


def _both(seed=0, groups=None, n=11):
  trajs = pi.trajs(seed, n=n, groups=groups)
  unpacked = pi.unpacked(trajs, 16)
  (packed,), _ = pi.packed(trajs, batch_size=3, seq_len=48, max_segments=6)
  assert packed["length"].min() == 0  # Empty slots are exercised too.
  return {k: jnp.asarray(v) for k, v in unpacked.items()}, {
      k: jnp.asarray(v) for k, v in packed.items()}


@pytest.mark.parametrize("estimator", ["decoupled_gae", "vapo_gae", "gae",
                                       "batch_whiten"])
def test_token_estimators_packed_equal_unpacked(estimator):
  un, pk = _both()
  cfg = step_lib.StepConfig(advantage=estimator, gamma=0.97, lam_critic=0.9)
  au, ru, _ = step_lib.compute_advantages(cfg, un, jnp.asarray(
      pi.token_values(un)), None)
  ap, rp, _ = step_lib.compute_advantages(cfg, pk, jnp.asarray(
      pi.token_values(pk)), None)
  pi.same_per_trajectory(au, un, ap, pk)
  pi.same_per_trajectory(ru, un, rp, pk)
  assert float(jnp.abs(au).sum()) > 1.0  # Not all zero.


@pytest.mark.parametrize("estimator", ["group_zscore", "group_mean", "rloo"])
def test_group_estimators_packed_equal_unpacked(estimator):
  un, pk = _both(groups=4)
  cfg = step_lib.StepConfig(advantage=estimator, max_groups=11 * 6)
  au, _, _ = step_lib.compute_advantages(cfg, un, jnp.zeros_like(
      un["rewards"]), None)
  ap, _, _ = step_lib.compute_advantages(cfg, pk, jnp.zeros_like(
      pk["rewards"]), None)
  pi.same_per_trajectory(au, un, ap, pk)
  assert float(jnp.abs(au).sum()) > 1.0


def test_running_mean_packed_equal_unpacked_and_skips_empty_slots():
  un, pk = _both()
  state = adv_lib.running_mean_init(16, k=4)
  state = adv_lib.running_mean_update(state, jnp.arange(11),
                                      jnp.linspace(-1, 1, 11))
  cfg = step_lib.StepConfig(advantage="running_mean")
  zeros = jnp.zeros_like
  au, _, su = step_lib.compute_advantages(cfg, un, zeros(un["rewards"]), state)
  ap, _, sp = step_lib.compute_advantages(cfg, pk, zeros(pk["rewards"]), state)
  pi.same_per_trajectory(au, un, ap, pk)
  np.testing.assert_array_equal(su.count, sp.count)  # No entry for empties.
  np.testing.assert_allclose(su.buffer, sp.buffer, atol=TOL)


def test_a_registered_estimator_runs_in_the_step_on_packed_rows(monkeypatch):
  # One register_advantage call adds an estimator (docs/design/extending.md):
  # the step's config takes its name, and on packed rows it sees each
  # trajectory as a row of its own with nothing written for packing.
  monkeypatch.setattr(adv_lib, "_ESTIMATORS", adv_lib._ESTIMATORS.copy())

  def sign_of_reward(cfg, x, state):  # A toy: the sign of each return.
    del cfg
    return x.on_actions(jnp.sign(x.seq_reward)), state

  adv_lib.register_advantage("toy_sign",
                             adv_lib.Estimator(sign_of_reward, "toy"))
  with pytest.raises(ValueError, match="already registered"):
    adv_lib.register_advantage("toy_sign", adv_lib.Estimator(
        sign_of_reward, "toy"))
  cfg = step_lib.StepConfig(loss="grpo", advantage="toy_sign")
  assert not cfg.uses_critic
  un, pk = _both()
  au, _, _ = step_lib.compute_advantages(cfg, un, jnp.zeros_like(
      un["rewards"]), None)
  ap, _, _ = step_lib.compute_advantages(cfg, pk, jnp.zeros_like(
      pk["rewards"]), None)
  mask = np.asarray(un["action_mask"], np.float32)
  want = np.sign((np.asarray(un["rewards"]) * mask).sum(-1))[:, None] * mask
  np.testing.assert_array_equal(np.asarray(au), want)
  assert np.any(want > 0) and np.any(want < 0)
  pi.same_per_trajectory(au, un, ap, pk)


def test_dis_and_value_losses_and_gradients_packed_equal_unpacked():
  un, pk = _both(seed=1)
  out = {}
  for name, batch in (("un", un), ("pk", pk)):
    values = jnp.asarray(pi.token_values(batch, seed=5))
    adv, returns, _ = step_lib.compute_advantages(
        step_lib.StepConfig(), batch, values, None)
    logp = batch["rollout_logp"] + 0.3 * jnp.asarray(pi.token_values(batch, 2))
    mask = batch["action_mask"]

    def total(lp, v, adv=adv, returns=returns, batch=batch, mask=mask):
      pol, _ = losses.dis_policy_loss(lp, batch["rollout_logp"], adv, mask)
      val, _ = losses.value_loss(v, returns, mask)
      return pol + val, (pol, val)

    (loss, parts), grads = jax.value_and_grad(
        total, argnums=(0, 1), has_aux=True)(logp, values)
    out[name] = (loss, parts, grads, batch)
  np.testing.assert_allclose(out["un"][0], out["pk"][0], atol=TOL)
  np.testing.assert_allclose(out["un"][1], out["pk"][1], atol=TOL)
  for g_un, g_pk in zip(out["un"][2], out["pk"][2]):
    pi.same_per_trajectory(g_un, un, g_pk, pk)
    assert float(jnp.abs(g_un).sum()) > 0.0


def test_nothing_leaks_across_segments():
  """Changing every reward, value and token of one trajectory of a packed
  row changes nothing of its row neighbours' advantages and targets."""
  _, pk = _both(seed=2)
  seg = pk["segment_ids"]
  victim = (seg[0] == 2)[None] & (jnp.arange(3) == 0)[:, None]
  other = pk["attention_mask"] & ~victim
  changed = dict(pk)
  changed["rewards"] = jnp.where(victim, 7.0, pk["rewards"])
  changed["tokens"] = jnp.where(victim, 2, pk["tokens"])
  v = jnp.asarray(pi.token_values(pk))
  for est in ("decoupled_gae", "gae", "batch_whiten"):
    cfg = step_lib.StepConfig(advantage=est)
    a0, r0, _ = step_lib.compute_advantages(cfg, pk, v, None)
    a1, r1, _ = step_lib.compute_advantages(cfg, changed,
                                            jnp.where(victim, -3.0, v), None)
    if est == "batch_whiten":  # Whitening is batch-wide by design.
      continue
    np.testing.assert_allclose(a0[other], a1[other], atol=TOL)
    np.testing.assert_allclose(r0[other], r1[other], atol=TOL)
    assert not np.allclose(a0[victim], a1[victim])


def test_segment_helpers():
  seg = jnp.asarray([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0]])
  np.testing.assert_array_equal(
      segments.segment_starts(seg), [[1, 0, 1, 0, 0, 1], [1, 1, 1, 0, 1, 0]])
  np.testing.assert_array_equal(
      segments.segment_ends(seg), [[0, 1, 0, 0, 1, 1], [1, 1, 0, 1, 0, 1]])
  x = jnp.arange(12.0).reshape(2, 6)
  np.testing.assert_array_equal(segments.segment_sum(x, seg, 3),
                                [[1, 9, 0], [6, 7, 17]])
  np.testing.assert_array_equal(
      segments.shift_right_within(x, seg),
      [[0, 0, 0, 2, 3, 0], [0, 0, 0, 8, 0, 10]])
  np.testing.assert_array_equal(
      segments.to_tokens(jnp.asarray([[5, 6, 0], [7, 8, 9]]), seg),
      [[5, 5, 6, 6, 6, 0], [7, 8, 9, 9, 0, 0]])
