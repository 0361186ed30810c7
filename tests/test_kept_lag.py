"""cleanba_utils.kept_lag: what a "keep_lag" script's checkpoint holds of what it hands
`Run.after_update`, and a checkpoint saved under its fields' old names resuming (the scripts' resume
tests show the whole run resumed bit for bit)."""

import flax.serialization
import jax
import numpy as np

from cleanba_utils import checkpoints, env_records, kept_lag
from cleanba_utils.devices import replicate
from cleanba_utils.replay.prioritized_learning import NO_PENDING, PendingPriorities
from cleanba_utils.replay.store import ReplayStore


def filled_replay():
    """A uniform replay of scalars 0, 1, 2 whose mark is taken then, and 3, 4 inserted after."""
    replay = ReplayStore({"x": np.float32(0)}, 8, uniform=True)
    replay.insert({"x": np.arange(3, dtype=np.float32)})
    mark = replay.mark()
    replay.insert({"x": np.arange(3, 5, dtype=np.float32)})
    return replay, mark


def test_the_checkpoint_holds_the_first_replica_the_replay_at_its_mark_and_pending_td_on_host():
    devices = jax.local_devices()[:2]
    replay, mark = filled_replay()
    empty = ReplayStore({"x": np.float32(0)}, 8, uniform=True).snapshot()
    record = env_records.empty_record(2, "Hopper-v4")
    kept = kept_lag.Continuation(
        learner=replicate({"w": np.arange(3.0, dtype=np.float32)}, devices),
        acting_params={"w": np.ones(3, np.float32)},
        env_record=record,
        replay=mark,
        pending_priorities=PendingPriorities(
            slots=np.array([1, 2]),
            inserted=3,
            td=replicate(np.array([0.5, -0.25], np.float32), devices),
        ),
        actor_carry=("the actors' carry",),
    )
    checkpoint = kept_lag.on_host(kept, replay=replay, empty_replay=empty)
    np.testing.assert_array_equal(np.asarray(checkpoint.learner["w"]), [0.0, 1.0, 2.0])
    assert np.shape(checkpoint.learner["w"]) == (3,)  # one copy, not the devices' stack
    assert checkpoint.acting_params is kept.acting_params and checkpoint.env_record is record
    assert checkpoint.actor_carry == ("the actors' carry",)
    # The replay as it was at the mark: 3 items, not the 5 inserted by now.
    restored = ReplayStore({"x": np.float32(0)}, 8, uniform=True)
    restored.restore(checkpoint.replay)
    assert restored.size == 3 and restored.inserted == 3
    np.testing.assert_array_equal(restored.items["x"][:3], [0.0, 1.0, 2.0])
    assert isinstance(checkpoint.pending_priorities.td, np.ndarray)
    np.testing.assert_array_equal(checkpoint.pending_priorities.td, [0.5, -0.25])
    # A script that does not save its replay (Ape-X DPG's --no-checkpoint-replay): an empty replay
    # and no pending priorities, whose transitions are not in it.
    without = kept_lag.on_host(kept, replay=None, empty_replay=empty)
    assert without.replay is empty and without.pending_priorities is NO_PENDING


def test_a_checkpoint_saved_under_the_fields_old_names_resumes():
    """`Continuation`'s `actor_carry` and `pending_priorities` were saved as "own" and "pending":
    such a checkpoint restores into today's structure."""
    template = kept_lag.Continuation(
        learner={"w": np.zeros(2, np.float32)},
        acting_params={"w": np.zeros(2, np.float32)},
        env_record=env_records.empty_record(2, "Hopper-v4"),
        replay={},
        pending_priorities=NO_PENDING,
        actor_carry=np.zeros(2),
    )
    saved = flax.serialization.to_state_dict(
        template._replace(learner={"w": np.array([1.0, 2.0], np.float32)}, actor_carry=np.ones(2))
    )
    saved["own"] = saved.pop("actor_carry")
    saved["pending"] = saved.pop("pending_priorities")
    restored = checkpoints.restored_state("old.ckpt", template, saved)
    np.testing.assert_array_equal(restored.learner["w"], [1.0, 2.0])
    np.testing.assert_array_equal(restored.actor_carry, [1.0, 1.0])
    assert len(restored.pending_priorities.slots) == 0
