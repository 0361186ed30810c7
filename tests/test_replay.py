"""cleanba_utils/replay/store.py against brute-force references: sampling probabilities, importance
weights, FIFO and prioritized eviction, priority updates, reproducibility, the background jobs."""

import threading
import time
from typing import NamedTuple

import numpy as np
import pytest
from scipy import stats

from cleanba_utils.replay.store import ReplayStore, store_bytes
from cleanba_utils.threads import BackgroundJobs, Stopped


class Item(NamedTuple):
    obs: np.ndarray
    action: np.ndarray


def items_of(ids) -> Item:
    """Items whose fields all encode their id: obs (3, 2) uint8 filled with id % 256, action id."""
    ids = np.asarray(ids)
    return Item(
        obs=np.broadcast_to((ids % 256).astype(np.uint8)[:, None, None], (len(ids), 3, 2)).copy(),
        action=ids.astype(np.int64),
    )


def store(capacity, **options) -> ReplayStore:
    return ReplayStore(
        Item(obs=np.zeros((3, 2), np.uint8), action=np.int64(0)), capacity, **options
    )


def reference_probabilities(priorities, alpha):
    """P(i) = p_i ** alpha / sum_k p_k ** alpha, priority 0 never."""
    weights = np.where(priorities > 0, np.abs(priorities) ** alpha, 0.0)
    return weights / weights.sum()


def copied(snapshot: dict) -> dict:
    return {
        key: (Item(*[field.copy() for field in value]) if key == "items" else np.copy(value))
        for key, value in snapshot.items()
    }


def assert_same_snapshot(snapshot: dict, reference: dict):
    assert snapshot.keys() == reference.keys()
    for key in reference:
        if key == "items":
            for field, expected in zip(snapshot[key], reference[key]):
                np.testing.assert_array_equal(field, expected)
        else:
            np.testing.assert_array_equal(snapshot[key], reference[key])


@pytest.mark.parametrize("eviction_exponent", [None, -0.4])
def test_a_snapshot_at_a_mark_is_the_store_as_it_was_then(eviction_exponent):
    # The reference: copies of the whole snapshot taken at each mark. Between and after the marks,
    # insertions that fill and then evict (FIFO or prioritized) and priority updates.
    rng = np.random.default_rng(1)
    replay = store(20, eviction_exponent=eviction_exponent)
    replay.insert(items_of(np.arange(12)), rng.uniform(0.1, 2, 12), rng)
    first = replay.mark()
    at_first = copied(replay.snapshot())
    replay.insert(items_of(np.arange(12, 27)), rng.uniform(0.1, 2, 15), rng)
    sample = replay.sample(8, rng, beta=0.4)
    replay.update_priorities(sample.slots, rng.uniform(0.1, 2, 8), sample.inserted)
    second = replay.mark()
    at_second = copied(replay.snapshot())
    assert_same_snapshot(replay.snapshot_at(second), at_second)
    for _ in range(3):
        replay.insert(items_of(np.arange(27, 36)), rng.uniform(0.1, 2, 9), rng)
        sample = replay.sample(8, rng, beta=0.4)
        replay.update_priorities(sample.slots, rng.uniform(0.1, 2, 8), sample.inserted)
    now = copied(replay.snapshot())
    assert_same_snapshot(replay.snapshot_at(first), at_first)
    assert_same_snapshot(replay.snapshot_at(second), at_second)
    # The store itself is unchanged by them, and only the two newest marks are kept.
    assert_same_snapshot(replay.snapshot(), now)
    replay.mark()
    with pytest.raises(ValueError, match="no longer kept"):
        replay.snapshot_at(first)
    assert_same_snapshot(replay.snapshot_at(second), at_second)


def test_samples_in_proportion_to_priority_to_the_alpha_with_reference_weights():
    rng = np.random.default_rng(0)
    priorities = rng.uniform(0.05, 3.0, size=30)
    priorities[[4, 17]] = 0.0  # placeholders
    replay = store(30, priority_exponent=0.7)
    replay.insert(items_of(np.arange(30)), priorities)
    expected = reference_probabilities(priorities, 0.7)
    counts = np.zeros(30)
    for _ in range(300):
        sample = replay.sample(256, rng, beta=0.4)
        counts += np.bincount(sample.slots, minlength=30)
        np.testing.assert_allclose(sample.probabilities, expected[sample.slots], rtol=1e-12)
        # Importance weights: (1 / (N P(i))) ** beta over the batch maximum, N cancelling.
        reference = (1 / expected[sample.slots]) ** 0.4
        np.testing.assert_allclose(sample.weights, reference / reference.max(), rtol=1e-6)
        np.testing.assert_array_equal(sample.items.action, sample.slots)
        np.testing.assert_array_equal(sample.items.obs[:, 2, 1], sample.slots % 256)
    assert counts[[4, 17]].sum() == 0
    sampleable = priorities > 0
    assert stats.chisquare(counts[sampleable], counts.sum() * expected[sampleable]).pvalue > 1e-3
    # The test can tell the wrong law: sampling in proportion to the priority itself.
    wrong = reference_probabilities(priorities, 1.0)[sampleable]
    assert stats.chisquare(counts[sampleable], counts.sum() * wrong).pvalue < 1e-6


def test_uniform_mode_samples_every_stored_item_alike_with_weights_one():
    rng = np.random.default_rng(1)
    replay = store(16, uniform=True)
    replay.insert(items_of(np.arange(10)))
    counts = np.zeros(16)
    for _ in range(200):
        sample = replay.sample(64, rng, beta=0.4)
        np.testing.assert_array_equal(sample.weights, 1.0)
        np.testing.assert_allclose(sample.probabilities, 1 / 10)
        counts += np.bincount(sample.slots, minlength=16)
    assert counts[10:].sum() == 0
    assert stats.chisquare(counts[:10]).pvalue > 1e-3


def test_fifo_eviction_replaces_the_oldest_items_first():
    replay = store(7)
    reference = []  # the stored ids, oldest first
    rng = np.random.default_rng(2)
    next_id = 0
    for count in [3, 2, 4, 1, 7, 5, 9]:
        ids = np.arange(next_id, next_id + count)
        next_id += count
        slots = replay.insert(items_of(ids), rng.uniform(0.1, 1, count))
        reference = (reference + list(ids))[-7:]
        assert sorted(replay.items.action[: replay.size].tolist()) == sorted(reference)
        # Each item sits in the slot that the oldest item left.
        np.testing.assert_array_equal(replay.items.action[slots[-min(count, 7) :]], ids[-7:])
    assert replay.size == 7 and replay.inserted == next_id


def test_prioritized_eviction_draws_in_proportion_to_priority_to_the_exponent():
    priorities = np.array([0.1, 0.5, 1.0, 2.0, 4.0, 0.25])
    expected = priorities**-0.4 / (priorities**-0.4).sum()
    rng = np.random.default_rng(3)
    evicted = []
    for _ in range(3000):
        replay = store(6, eviction_exponent=-0.4)
        replay.insert(items_of(np.arange(6)), priorities)
        evicted.append(replay.insert(items_of([99]), [1.0], rng=rng)[0])
    counts = np.bincount(evicted, minlength=6)
    assert stats.chisquare(counts, 3000 * expected).pvalue > 1e-3
    # Several at once: distinct slots, the new items in them, the others kept.
    replay = store(6, eviction_exponent=-0.4)
    replay.insert(items_of(np.arange(6)), priorities)
    slots = replay.insert(items_of([100, 101, 102, 103]), np.ones(4), rng=rng)
    assert len(set(slots.tolist())) == 4
    np.testing.assert_array_equal(replay.items.action[slots], [100, 101, 102, 103])
    kept = np.setdiff1d(np.arange(6), slots)
    np.testing.assert_array_equal(replay.items.action[kept], kept)
    with pytest.raises(ValueError, match="rng"):
        replay.insert(items_of([7]), [1.0])


def test_priority_updates_take_effect_but_not_on_slots_rewritten_since_the_sample():
    rng = np.random.default_rng(4)
    replay = store(4)
    replay.insert(items_of(np.arange(4)), np.ones(4))
    sample = replay.sample(8, rng, beta=0.4)
    replay.insert(items_of([10]), [3.0])  # slot 0: item 0 evicted
    replay.update_priorities(np.arange(4), [7.0, 5.0, 0.5, 1.0], sampled_at=sample.inserted)
    expected = reference_probabilities(np.array([3.0, 5.0, 0.5, 1.0]), 0.6)
    probabilities = replay.sample(4, rng, beta=0.4).probabilities
    np.testing.assert_allclose(
        replay.priorities(), [3.0, 5.0, 0.5, 1.0], rtol=1e-12
    )  # slot 0 kept its new item's priority
    assert set(np.round(probabilities, 12)) <= set(np.round(expected, 12))
    assert replay.num_sampleable() == 4


def test_same_seed_same_samples_and_evictions():
    def history(seed):
        rng = np.random.default_rng(seed)
        priorities = np.random.default_rng(0).uniform(0.1, 2, 200)
        replay = store(50, eviction_exponent=-0.4)
        drawn = []
        for start in range(0, 200, 20):
            drawn.append(
                replay.insert(
                    items_of(np.arange(start, start + 20)), priorities[start : start + 20], rng=rng
                )
            )
            sample = replay.sample(16, rng, beta=0.4)
            replay.update_priorities(sample.slots, sample.slots + 1.0, sampled_at=sample.inserted)
            drawn.append(sample.slots)
        return np.concatenate(drawn)

    np.testing.assert_array_equal(history(7), history(7))
    assert not np.array_equal(history(7), history(8))


def test_a_dict_of_fields_of_any_shape():
    replay = ReplayStore({"x": np.zeros((2, 3), np.float32), "done": np.bool_(False)}, 5)
    replay.insert({"x": np.arange(24, dtype=np.float32).reshape(4, 2, 3), "done": np.ones(4, bool)})
    sample = replay.sample(3, np.random.default_rng(0), beta=1.0)
    assert sample.items["x"].shape == (3, 2, 3) and sample.items["done"].all()
    np.testing.assert_array_equal(sample.items["x"][:, 0, 0], 6 * sample.slots)


def test_background_jobs_run_in_order_and_a_failure_stops_the_waiter():
    stop = threading.Event()
    failures = []
    jobs = BackgroundJobs("test-jobs", stop, failures)
    order = []
    handles = [jobs.submit(lambda i=i: order.append(i) or i * i) for i in range(20)]
    assert [jobs.wait(handle) for handle in reversed(handles)] == [i * i for i in range(19, -1, -1)]
    assert order == list(range(20))

    def explode():
        raise RuntimeError("sampler exploded")

    jobs.submit(explode)
    never = jobs.submit(lambda: 1)
    start = time.time()
    with pytest.raises(Stopped):
        jobs.wait(never)
    assert time.time() - start < 2 and stop.is_set()
    assert "sampler exploded" in failures[0]


@pytest.mark.parametrize("options", [dict(), dict(uniform=True), dict(eviction_exponent=-0.4)])
def test_many_batches_at_once_are_the_batches_of_one_sample_each(options):
    replay = store(64, **options)
    rng = np.random.default_rng(0)
    replay.insert(items_of(np.arange(100)), rng.uniform(0.1, 2.0, 100), rng=rng)
    many = replay.sample_many(16, [np.random.default_rng([7, step]) for step in range(5)], beta=0.4)
    for step in range(5):
        one = replay.sample(16, np.random.default_rng([7, step]), beta=0.4)
        np.testing.assert_array_equal(many.slots[step], one.slots)
        np.testing.assert_array_equal(many.items.obs[step], one.items.obs)
        np.testing.assert_array_equal(many.weights[step], one.weights)
        np.testing.assert_array_equal(many.probabilities[step], one.probabilities)


@pytest.mark.parametrize("options", [dict(), dict(uniform=True), dict(eviction_exponent=-0.4)])
def test_a_restored_snapshot_samples_inserts_and_evicts_as_the_original(options):
    # Half full, and full after evictions: the restored store goes on as the original.
    for inserted in (20, 150):
        original = store(64, **options)
        rng = np.random.default_rng(1)
        original.insert(items_of(np.arange(inserted)), rng.uniform(0.1, 2.0, inserted), rng=rng)
        restored = store(64, **options)
        restored.restore(original.snapshot())
        assert (restored.size, restored.inserted) == (original.size, original.inserted)
        for replay in (original, restored):
            more = np.arange(1000, 1030)
            replay.insert(items_of(more), np.linspace(0.2, 1.0, 30), rng=np.random.default_rng(2))
            replay.update_priorities([0, 5], [3.0, 0.5], sampled_at=replay.inserted - 30)
        for a, b in zip(original.items, restored.items):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(original.tree, restored.tree)
        np.testing.assert_array_equal(original.written_at, restored.written_at)
        a = original.sample(32, np.random.default_rng(3), beta=0.4)
        b = restored.sample(32, np.random.default_rng(3), beta=0.4)
        np.testing.assert_array_equal(a.slots, b.slots)


@pytest.mark.parametrize("capacity", [1, 5, 64, 1000])
@pytest.mark.parametrize("eviction_exponent", [None, -0.4])
def test_store_bytes_is_what_a_store_allocates(capacity, eviction_exponent):
    example = {
        "obs": np.zeros(7, np.float32),
        "action": np.int32(0),
        "frames": np.zeros(3, np.int64),
    }
    store = ReplayStore(example, capacity, eviction_exponent=eviction_exponent)
    arrays = [*store.items.values(), store.tree, store.written_at]
    if store.eviction_tree is not None:
        arrays.append(store.eviction_tree)
    needed = store_bytes(example, capacity, prioritized_eviction=eviction_exponent is not None)
    assert needed == sum(array.nbytes for array in arrays)
