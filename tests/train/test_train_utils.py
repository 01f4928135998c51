"""Tests for TensorBoard metrics, orbax checkpoints and optimizers."""

import os
import signal
import time

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tensorboard.backend.event_processing import event_accumulator

from sao_jax.ipc import segment
from sao_jax.train import checkpoint
from sao_jax.train import finish
from sao_jax.train import metrics
from sao_jax.train import optim


def test_scalars_and_histograms_read_back(tmp_path):
  logdir = str(tmp_path / "tb")
  with metrics.MetricWriter(logdir) as w:
    w.write_scalars(1, {"reward": 0.25, "loss/policy": -1.5})
    w.write_scalars(2, {"reward": 0.75})
    w.write_histograms(2, {"staleness": np.array([0, 1, 1, 3])})
  got = metrics.read_scalars(logdir)
  assert got["reward"] == [(1, 0.25), (2, 0.75)]
  assert got["loss/policy"] == [(1, -1.5)]
  files = [f for f in os.listdir(logdir) if f.startswith("events")]
  acc = event_accumulator.EventAccumulator(os.path.join(logdir, files[0]))
  acc.Reload()
  (h,) = acc.Histograms("staleness")
  assert h.step == 2
  assert h.histogram_value.num == 4
  assert h.histogram_value.sum == 5
  assert h.histogram_value.max == 3
  assert sum(h.histogram_value.bucket) == 4


def test_closed_writer_raises(tmp_path):
  w = metrics.MetricWriter(str(tmp_path))
  w.close()
  with pytest.raises(RuntimeError, match="already closed"):
    w.write_scalars(0, {"a": 1.0})


def test_inactive_writer_writes_nothing(tmp_path):
  logdir = tmp_path / "tb"
  w = metrics.MetricWriter(str(logdir), active=False)  # A non-primary host.
  w.write_scalars(1, {"reward": 0.5})
  w.write_histograms(1, {"staleness": np.array([0, 1])})
  w.flush()
  w.close()
  assert not logdir.exists()
  with pytest.raises(RuntimeError, match="already closed"):
    w.write_scalars(2, {"reward": 0.5})


def _state():
  return {
      "params": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones((3,))},
      "step": jnp.asarray(7, jnp.int32),
      "rng": jax.random.PRNGKey(3),
  }


def test_checkpoint_round_trip(tmp_path):
  ck = checkpoint.Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
  state = _state()
  meta = {"policy_version": 5, "prompt_iter": {"next_index": 17}}
  ck.save(3, state, meta)
  state2 = jax.tree.map(lambda x: x + 1, state)
  ck.save(4, state2, {"policy_version": 6})
  ck.save(5, state2, {"policy_version": 7})
  assert sorted(int(d) for d in os.listdir(ck.directory) if d.isdigit()) == [
      4, 5]  # max_to_keep=2
  restored, meta_r, step = ck.restore(jax.tree.map(jnp.zeros_like, state), 4)
  assert step == 4 and meta_r == {"policy_version": 6}
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, meta_new, step_new = ck.restore(state)
  assert step_new == 5 and meta_new["policy_version"] == 7
  ck.close()



@flax.struct.dataclass
class _Stepped:
  step: jax.Array
  w: jax.Array


def test_save_on_exit_saves_only_the_state_meta_goes_with(tmp_path):
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  meta = {"episodes_consumed": 24}
  state = _Stepped(jnp.asarray(4, jnp.int32), jnp.ones(3))
  # Stopped after step 4's dispatch, before the loop marked it as meta's.
  finish.save_on_exit(ck, state, meta, meta_step=3, start_step=0)
  assert ck.latest_step() is None
  # Stopped while waiting for step 4's result: step 4 is saved with meta.
  finish.save_on_exit(ck, state, meta, meta_step=4, start_step=0)
  assert ck.latest_step() == 4
  restored, meta_r, _ = ck.restore(_Stepped(jnp.zeros((), jnp.int32),
                                            jnp.zeros(3)))
  assert int(restored.step) == 4 and meta_r == meta
  # Nothing done since the run (re)started: nothing to save.
  ck2 = checkpoint.Checkpointer(str(tmp_path / "ck2"))
  finish.save_on_exit(ck2, state, meta, meta_step=4, start_step=4)
  assert ck2.latest_step() is None
  ck.close()
  ck2.close()


def test_a_second_sigterm_waits_for_the_save_on_exit(tmp_path):
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  state = _Stepped(jnp.asarray(3, jnp.int32), jnp.ones(3))
  save = ck.save

  def signalled_save(*args):
    os.kill(os.getpid(), signal.SIGTERM)  # Arrives while the save runs.
    time.sleep(0.2)  # Handlers run between bytecodes: it has been handled.
    save(*args)

  ck.save = signalled_save
  with pytest.raises(KeyboardInterrupt, match="signal 15"):
    with segment.sigterm_unwinds():
      finish.save_on_exit(ck, state, {"episodes_consumed": 8}, meta_step=3,
                          start_step=0)
  assert ck.latest_step() == 3  # Saved whole, then unwound.
  ck.close()


def test_checkpoint_missing_and_malformed(tmp_path):
  ck = checkpoint.Checkpointer(str(tmp_path / "empty"))
  with pytest.raises(checkpoint.CheckpointError, match="No checkpoint found"):
    ck.restore(_state())
  ck2 = checkpoint.Checkpointer(str(tmp_path / "bad"))
  ck2.save(1, _state(), {"v": 1})
  # Restoring into a state of a different shape names the directory.
  wrong = _state()
  wrong["params"]["w"] = jnp.zeros((4, 4))
  with pytest.raises(checkpoint.CheckpointError, match=str(tmp_path / "bad")):
    ck2.restore(wrong)
  # Corrupt the array files on disk.
  for root, _, files in os.walk(tmp_path / "bad" / "1" / "state"):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"garbage")
  with pytest.raises(checkpoint.CheckpointError, match="could not be restored"):
    ck2.restore(_state(), 1)


def test_schedule_values():
  s = optim.make_schedule(1.0, warmup_steps=4, schedule="cosine",
                          total_steps=14)
  np.testing.assert_allclose(
      [float(s(i)) for i in (0, 2, 4, 9, 14)], [0.0, 0.5, 1.0, 0.5, 0.0],
      atol=1e-6)
  c = optim.make_schedule(0.3, warmup_steps=0, schedule="constant",
                          total_steps=10)
  assert float(c(100)) == pytest.approx(0.3)
  with pytest.raises(ValueError, match="Unknown schedule 'linaer'"):
    optim.make_schedule(1.0, warmup_steps=0, schedule="linaer", total_steps=1)


def test_frozen_attention_updates_only_the_rest():
  params = {
      "layer_0": {"attn": {"q_proj": jnp.ones((2, 2))},
                  "mlp": {"up": jnp.ones((2, 2))}},
      "value_head": {"kernel": jnp.ones((2, 1))},
  }
  labels = optim.frozen_attention_labels(params)
  assert labels["layer_0"]["attn"]["q_proj"] == "frozen"
  assert labels["layer_0"]["mlp"]["up"] == "train"
  tx = optim.make_optimizer(0.1, labels=labels, grad_clip=1.0)
  opt_state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, opt_state, params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["layer_0"]["attn"]["q_proj"], 1.0)
  # Adam's first step moves each trained leaf by -lr * sign(g) (bias-corrected).
  np.testing.assert_allclose(new["layer_0"]["mlp"]["up"], 0.9, atol=1e-5)
  np.testing.assert_allclose(new["value_head"]["kernel"], 0.9, atol=1e-5)


def test_run_clock_steady_state_excludes_compiles_and_is_never_negative():
  clock = metrics.RunClock()
  clock.step_done(1, last_compile_before=1)  # Compiling steps.
  clock.step_done(2, last_compile_before=1)
  clock.step_done(3, last_compile_before=1)  # The steady state begins.
  # No steady step yet (a resumed run stopped here once logged
  # train_wall_s = -30892, 0 - the start time).
  assert clock.steady_steps == 0 and clock.steady_s == 0.0
  clock.step_done(4, last_compile_before=1)
  assert clock.steady_steps == 1
  assert clock.steady_s == clock.steady_end - clock.steady_start > 0.0
