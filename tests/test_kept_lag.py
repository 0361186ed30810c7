"""cleanba_utils.kept_lag: what a "keep_lag" script's checkpoint holds of what it hands
`Run.after_update` (the scripts' resume tests show the whole run resumed bit for bit)."""

import jax
import numpy as np

from cleanba_utils import env_records, kept_lag
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
        pending=PendingPriorities(
            slots=np.array([1, 2]),
            inserted=3,
            td=replicate(np.array([0.5, -0.25], np.float32), devices),
        ),
        own=("the script's",),
    )
    checkpoint = kept_lag.on_host(kept, replay=replay, empty_replay=empty)
    np.testing.assert_array_equal(np.asarray(checkpoint.learner["w"]), [0.0, 1.0, 2.0])
    assert np.shape(checkpoint.learner["w"]) == (3,)  # one copy, not the devices' stack
    assert checkpoint.acting_params is kept.acting_params and checkpoint.env_record is record
    assert checkpoint.own == ("the script's",)
    # The replay as it was at the mark: 3 items, not the 5 inserted by now.
    restored = ReplayStore({"x": np.float32(0)}, 8, uniform=True)
    restored.restore(checkpoint.replay)
    assert restored.size == 3 and restored.inserted == 3
    np.testing.assert_array_equal(restored.items["x"][:3], [0.0, 1.0, 2.0])
    assert isinstance(checkpoint.pending.td, np.ndarray)
    np.testing.assert_array_equal(checkpoint.pending.td, [0.5, -0.25])
    # A script that does not save its replay (Ape-X DPG's --no-checkpoint-replay): an empty replay
    # and no pending priorities, whose transitions are not in it.
    without = kept_lag.on_host(kept, replay=None, empty_replay=empty)
    assert without.replay is empty and without.pending is NO_PENDING
