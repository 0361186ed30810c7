"""The replay of the off-policy scripts: a store of a fixed number of items, each a record of named
fields (a NamedTuple or a dict of NumPy arrays, each field of any shape and dtype), with

- insertion, evicting the oldest items first (FIFO), or with `eviction_exponent`, items drawn in
  proportion to priority ** eviction_exponent (Ape-X DPG evicts "by prioritized sampling with
  exponent -0.4", so low-priority items go first);
- sampling in proportion to priority ** priority_exponent (Schaul et al., 2016) with
  importance-sampling weights, or uniform sampling (`uniform=True`, weights 1), of one batch or of
  many at once;
- priority updates of sampled items, which skip the items overwritten since they were sampled;
- a snapshot of everything it holds, for checkpoints, and the restore of one;
- marks: `mark()` starts keeping what each later change overwrites, so that `snapshot_at(mark)`
  gives the store as it was at the mark, after it has changed (a learner stopped in the middle of
  an update saves the checkpoint of the update before, whose rollouts it has already inserted).
  Every change holds `lock`: a thread that holds it sees the store stand still.

Every random choice comes from the `np.random.Generator` the caller passes, so a seeded generator
gives the same samples and evictions on every run. The priorities live in `sum_tree` (float64, so
the sums never drift). An item inserted with priority 0 is stored but never sampled: a placeholder
that keeps the FIFO order of a stream in which some steps start no transition.

What an algorithm stores and how it builds its batch (n-step returns, frame stacks, priorities from
TD errors) stays in its script; `threads.BackgroundJobs` runs the replay's work in one background
thread, in the order it was submitted, so a learner can sample the next batch while its update runs.

Why not flashbax (0.1.3: JAX-native and seedable, the candidate; reverb and cpprb cannot be seeded).
Speed does not decide it (benchmark/results/replay_apex.md, 2026-11-23, times its sample and add
beside this store's). Its model does:
- it has no prioritized eviction (Ape-X DPG's), only first in first out;
- it stores time steps and samples fixed-length sequences, whose priorities belong to their first
  step, and which cross episode ends and the buffer's wrap; transitions with their own n-step
  returns, offsets and placeholders do not map onto it without masks in every script;
- its buffer is an immutable pytree that every `add` returns anew: only buffer donation keeps an add
  from copying the whole replay (the size of Ape-X DQN's default replay is in replay_apex.md).
A NumPy store on the host does each of these in a few lines and leaves JAX the learner.
"""

import threading
from typing import Any, NamedTuple

import numpy as np

from cleanba_utils.replay import sum_tree

MIN_EVICTION_PRIORITY = 1e-6
"""The priority an item of priority 0 has for prioritized eviction (a negative exponent of 0 is
infinite): placeholders go first."""


def map_fields(function, record):
    """`record` with `function` applied to each field (a NamedTuple or a dict)."""
    if isinstance(record, dict):
        return {key: function(value) for key, value in record.items()}
    return type(record)(*[function(value) for value in record])


def store_bytes(example, capacity: int, *, prioritized_eviction: bool = False) -> int:
    """The memory a `ReplayStore(example, capacity, ...)` takes: its items, their insertion counts
    (int64) and its sum tree (a second one with prioritized eviction)."""
    fields = example.values() if isinstance(example, dict) else example
    item_bytes = sum(np.asarray(field).nbytes for field in fields) + 8
    num_trees = 2 if prioritized_eviction else 1
    return capacity * item_bytes + num_trees * sum_tree.tree_bytes(capacity)


class Overwritten(NamedTuple):
    """What one change of the store overwrote: its slots, and their items, sampling and eviction
    weights and insertion counts before it."""

    slots: np.ndarray
    items: Any
    weights: np.ndarray
    eviction_weights: np.ndarray | None
    written_at: np.ndarray


class Mark(NamedTuple):
    """The store's size and insertion count at a mark, and how many changes came before it."""

    size: int
    inserted: int
    changes_before: int


class Sample(NamedTuple):
    """A sampled batch: the slots, the items' fields, their sampling probabilities, their
    importance-sampling weights ((1 / probability) ** beta over the batch's maximum, all 1 when
    uniform), and `inserted`, the number of items inserted before the sample (what
    `update_priorities` needs to skip the slots overwritten since)."""

    slots: np.ndarray
    items: Any
    probabilities: np.ndarray
    weights: np.ndarray
    inserted: int


class ReplayStore:
    """`capacity` items of the record type of `example` (one item: a NamedTuple or dict of arrays
    whose shapes and dtypes the stored fields take)."""

    def __init__(
        self,
        example,
        capacity: int,
        *,
        priority_exponent: float = 0.6,
        uniform: bool = False,
        eviction_exponent: float | None = None,
    ):
        self.capacity = capacity
        self.priority_exponent = priority_exponent
        self.uniform = uniform
        self.eviction_exponent = eviction_exponent
        self.items = map_fields(
            lambda field: np.zeros((capacity, *np.shape(field)), np.asarray(field).dtype), example
        )
        self.tree = sum_tree.empty(capacity)
        self.eviction_tree = None if eviction_exponent is None else sum_tree.empty(capacity)
        self.written_at = np.full(capacity, -1, np.int64)
        """the number of items inserted before each slot's item"""
        self.size = 0
        self.inserted = 0
        self.lock = threading.RLock()
        self.changes: list[Overwritten] = []
        """what the changes since the oldest kept mark overwrote, oldest first"""
        self.changes_dropped = 0
        """changes no longer kept, before `changes[0]`"""
        self.marks: list[Mark] = []
        self.evicted_weights: list[np.ndarray] = []

    def sampling_weights(self, priorities) -> np.ndarray:
        """priority ** priority_exponent, 0 for priority 0 (also with exponent 0); when uniform, 1
        for every priority but 0."""
        priorities = np.asarray(priorities, np.float64)
        if self.uniform:
            return (priorities > 0).astype(np.float64)
        safe = np.where(priorities > 0, priorities, 1.0)
        return np.where(priorities > 0, safe**self.priority_exponent, 0.0)

    def free_slots(self, count: int, rng) -> np.ndarray:
        """Where the next `count` items go: empty slots first, then the oldest items (FIFO), or
        items drawn without replacement in proportion to priority ** eviction_exponent."""
        if self.eviction_tree is None:
            return (self.inserted + np.arange(count)) % self.capacity
        empty = min(count, self.capacity - self.size)
        slots = np.arange(self.size, self.size + empty)
        evicted = count - empty
        if evicted and rng is None:
            raise ValueError("prioritized eviction draws from a generator: pass rng")
        chosen = []
        while evicted:
            drawn = np.unique(sum_tree.sample_stratified(self.eviction_tree, evicted, rng))
            self.evicted_weights.append(sum_tree.weights(self.eviction_tree, drawn))
            sum_tree.set_weights(self.eviction_tree, drawn, np.zeros(len(drawn)))
            chosen.append(drawn)
            evicted -= len(drawn)
        return np.concatenate([slots, *chosen])

    def insert(self, items, priorities=None, rng: np.random.Generator | None = None):
        """Stores a batch of items (each field with a leading batch axis) and returns their slots.
        `priorities` (one per item, default 1) may be 0 (stored, never sampled); `rng` is needed
        by prioritized eviction once the store is full. A batch larger than the capacity keeps its
        last items."""
        with self.lock:
            return self.insert_locked(items, priorities, rng)

    def insert_locked(self, items, priorities, rng):
        count = len(next(iter(items.values() if isinstance(items, dict) else items)))
        priorities = np.ones(count) if priorities is None else np.asarray(priorities, np.float64)
        if count > self.capacity:
            items = map_fields(lambda field: field[-self.capacity :], items)
            priorities = priorities[-self.capacity :]
            self.inserted += count - self.capacity
            count = self.capacity
        eviction_weights_before = None
        # Prioritized eviction zeroes the eviction weights of the items it draws (kept here).
        self.evicted_weights = []
        if self.marks and self.eviction_tree is not None:
            eviction_weights_before = sum_tree.weights(
                self.eviction_tree, np.arange(self.size, min(self.size + count, self.capacity))
            )
        slots = self.free_slots(count, rng)
        if self.marks:
            if eviction_weights_before is not None:
                eviction_weights_before = np.concatenate(
                    [eviction_weights_before, *self.evicted_weights]
                )
            self.keep_overwritten(slots, eviction_weights_before)
        for stored, field in zip(self.fields(self.items), self.fields(items)):
            stored[slots] = field
        self.set_priorities(slots, priorities)
        self.written_at[slots] = self.inserted + np.arange(count)
        self.inserted += count
        self.size = min(self.capacity, self.size + count)
        return slots

    @staticmethod
    def fields(record) -> list:
        return list(record.values()) if isinstance(record, dict) else list(record)

    def sample(self, batch_size: int, rng: np.random.Generator, beta: float) -> Sample:
        """`batch_size` items, each with probability weight / total (one stratified draw in each of
        `batch_size` equal slices of the total: the same marginal probabilities as independent
        draws, less variance); with replacement."""
        total = self.sampleable_total()
        return self.sample_at(sum_tree.sample_stratified(self.tree, batch_size, rng), total, beta)

    def sample_many(self, batch_size: int, rngs: list, beta: float) -> Sample:
        """One batch per generator of `rngs`, each field stacked (len(rngs), batch_size, ...): the
        batches that `sample` draws with each generator in turn, found in one descent of the tree
        (a learner that makes many updates per rollout draws their batches at once)."""
        total = self.sampleable_total()
        targets = np.stack([sum_tree.stratified_targets(self.tree, batch_size, r) for r in rngs])
        slots = sum_tree.find(self.tree, targets.ravel()).reshape(targets.shape)
        return self.sample_at(slots, total, beta)

    def sampleable_total(self) -> float:
        total = sum_tree.total(self.tree)
        if total <= 0:
            raise ValueError("the replay has no item to sample")
        return total

    def sample_at(self, slots, total: float, beta: float) -> Sample:
        """The items of `slots` (a batch, or batches along the first axis) with their sampling
        probabilities and importance weights, normalized by each batch's largest weight."""
        probabilities = sum_tree.weights(self.tree, slots) / total
        weights = (probabilities.min(axis=-1, keepdims=True) / probabilities) ** beta
        return Sample(
            slots=slots,
            items=map_fields(lambda field: field[slots], self.items),
            probabilities=probabilities,
            weights=weights.astype(np.float32),
            inserted=self.inserted,
        )

    def update_priorities(self, slots, priorities, sampled_at: int):
        """New priorities of the items of `slots`, sampled when `sampled_at` items had been
        inserted; the slots rewritten since keep their new items' priorities. A slot listed twice
        must get one priority twice."""
        with self.lock:
            slots = np.asarray(slots)
            kept = self.written_at[slots] < sampled_at
            slots = slots[kept]
            priorities = np.asarray(priorities, np.float64)[kept]
            if self.marks:
                self.keep_overwritten(slots)
            self.set_priorities(slots, priorities)

    def set_priorities(self, slots, priorities):
        sum_tree.set_weights(self.tree, slots, self.sampling_weights(priorities))
        if self.eviction_tree is not None:
            eviction_weights = (
                np.maximum(priorities, MIN_EVICTION_PRIORITY) ** self.eviction_exponent
            )
            sum_tree.set_weights(self.eviction_tree, slots, eviction_weights)

    def stored_weights(self) -> np.ndarray:
        """The sampling weight of every stored item, in slot order (a view of the tree's leaves)."""
        first_leaf = sum_tree.num_leaves(self.tree)
        return self.tree[first_leaf : first_leaf + self.size]

    def priorities(self) -> np.ndarray:
        """The priority of every sampleable item; NaN when uniform."""
        weights = self.stored_weights()
        weights = weights[weights > 0]
        if self.uniform:
            return np.full(len(weights), np.nan)
        return weights ** (1 / max(self.priority_exponent, 1e-9))

    def num_sampleable(self) -> int:
        return int(np.count_nonzero(self.stored_weights()))

    def snapshot(self) -> dict:
        """What the store holds, for a checkpoint: the items of its filled slots (slots 0 .. size -
        1: empty slots are filled in order before any eviction), their sampling and eviction
        weights and insertion counts, and the number inserted. Views of the store's arrays, not
        a copy of the whole replay: save them before the store changes."""
        leaves = slice(sum_tree.num_leaves(self.tree), sum_tree.num_leaves(self.tree) + self.size)
        no_eviction = self.eviction_tree is None
        return dict(
            items=map_fields(lambda field: field[: self.size], self.items),
            weights=self.tree[leaves],
            eviction_weights=np.zeros(0) if no_eviction else self.eviction_tree[leaves],
            written_at=self.written_at[: self.size],
            inserted=int(self.inserted),
        )

    def keep_overwritten(self, slots, eviction_weights=None):
        """Keeps what a change of `slots` overwrites (`eviction_weights`: their eviction weights
        before the change, where the change has already set some)."""
        if self.eviction_tree is not None and eviction_weights is None:
            eviction_weights = sum_tree.weights(self.eviction_tree, slots)
        self.changes.append(
            Overwritten(
                slots=slots,
                items=map_fields(lambda field: field[slots], self.items),
                weights=sum_tree.weights(self.tree, slots),
                eviction_weights=eviction_weights,
                written_at=self.written_at[slots],
            )
        )

    def mark(self, keep: int = 2) -> Mark:
        """A mark of the store as it is now, for `snapshot_at`; the `keep` newest marks stay
        usable (the changes since the oldest of them are kept)."""
        with self.lock:
            self.marks = [
                *self.marks[-(keep - 1) :],
                Mark(self.size, self.inserted, self.changes_dropped + len(self.changes)),
            ]
            drop = self.marks[0].changes_before - self.changes_dropped
            del self.changes[:drop]
            self.changes_dropped += drop
            return self.marks[-1]

    def snapshot_at(self, mark: Mark) -> dict:
        """The `snapshot` of the store as it was at `mark`, one of the kept marks: views of the
        store's arrays when nothing changed since, else a copy with the overwritten values put back.
        """
        with self.lock:
            if mark not in self.marks:
                raise ValueError("snapshot_at: the mark is no longer kept")
            later = self.changes[mark.changes_before - self.changes_dropped :]
            if not later:
                return self.snapshot()
            snapshot = self.snapshot()
            snapshot = dict(
                items=map_fields(lambda field: field[: mark.size].copy(), snapshot["items"]),
                weights=snapshot["weights"][: mark.size].copy(),
                eviction_weights=snapshot["eviction_weights"][: mark.size].copy(),
                written_at=snapshot["written_at"][: mark.size].copy(),
                inserted=mark.inserted,
            )
            for change in reversed(later):
                # Slots filled after the mark were empty at it (empty slots fill in order).
                held = change.slots < mark.size
                slots = change.slots[held]
                for stored, before in zip(
                    self.fields(snapshot["items"]), self.fields(change.items)
                ):
                    stored[slots] = before[held]
                snapshot["weights"][slots] = change.weights[held]
                if change.eviction_weights is not None:
                    snapshot["eviction_weights"][slots] = change.eviction_weights[held]
                snapshot["written_at"][slots] = change.written_at[held]
            return snapshot

    def restore(self, snapshot: dict):
        """Sets an empty store of the same capacity and record type to a `snapshot`, after which it
        samples, inserts and evicts as the store it was taken from."""
        size = len(snapshot["written_at"])
        slots = np.arange(size)
        for stored, field in zip(self.fields(self.items), self.fields(snapshot["items"])):
            stored[:size] = field
        sum_tree.set_weights(self.tree, slots, snapshot["weights"])
        if self.eviction_tree is not None:
            sum_tree.set_weights(self.eviction_tree, slots, snapshot["eviction_weights"])
        self.written_at[:size] = snapshot["written_at"]
        self.size = size
        self.inserted = int(snapshot["inserted"])
