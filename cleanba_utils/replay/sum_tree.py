"""A sum tree in one NumPy array: non-negative weights of a fixed number of items, where setting a
batch of weights and drawing a batch of items in proportion to their weights cost O(log N) per item,
vectorized over the batch. Node 1 is the root, node i has the children 2i and 2i + 1, and the leaves
are the second half of the array (item k is node `num_leaves + k`). Every inner node is recomputed
from its two children, in float64, so the sums never drift however many updates the tree sees."""

import numpy as np


def leaves_for(capacity: int) -> int:
    """The leaves of a tree of `capacity` items: `capacity` rounded up to a power of two."""
    return 1 << max(0, capacity - 1).bit_length()


def empty(capacity: int) -> np.ndarray:
    """A tree of `capacity` items, all weights zero."""
    return np.zeros(2 * leaves_for(capacity), dtype=np.float64)


def tree_bytes(capacity: int) -> int:
    """The memory of `empty(capacity)`, without making it."""
    return 2 * leaves_for(capacity) * np.dtype(np.float64).itemsize


def num_leaves(tree: np.ndarray) -> int:
    return tree.shape[0] // 2


def total(tree: np.ndarray) -> float:
    return float(tree[1])


def weights(tree: np.ndarray, items) -> np.ndarray:
    return tree[num_leaves(tree) + np.asarray(items)]


def set_weights(tree: np.ndarray, items, values):
    """Sets the weights of `items` and their ancestors' sums; an item listed twice must get one
    value twice."""
    nodes = num_leaves(tree) + np.asarray(items, dtype=np.int64)
    tree[nodes] = values
    # All leaves share a depth, so the nodes climb one level per pass.
    while nodes.size and nodes[0] > 1:
        nodes = np.unique(nodes // 2)
        tree[nodes] = tree[2 * nodes] + tree[2 * nodes + 1]


def find(tree: np.ndarray, targets) -> np.ndarray:
    """The item whose interval of the cumulative weights holds each target in [0, total): a descent
    from the root in lockstep. An item of weight zero is never returned (a child of zero sum is
    never entered), even where float rounding puts a target on an interval's edge."""
    targets = np.array(targets, dtype=np.float64)
    nodes = np.ones(targets.shape, dtype=np.int64)
    leaves = num_leaves(tree)
    while leaves > 1 and nodes.size and nodes[0] < leaves:
        left = 2 * nodes
        left_sum = tree[left]
        go_right = ((targets >= left_sum) & (tree[left + 1] > 0)) | (left_sum <= 0)
        targets = np.where(go_right, targets - left_sum, targets)
        nodes = left + go_right
    return nodes - leaves


def stratified_targets(tree: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """One uniform draw in each of `batch_size` equal slices of [0, total)."""
    return (np.arange(batch_size) + rng.random(batch_size)) * (total(tree) / batch_size)


def sample_stratified(tree: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """`batch_size` items, each with probability weight / total: the items of `stratified_targets`,
    as Schaul et al. (2016) sample a prioritized replay (lower variance than independent draws, the
    same marginal probabilities)."""
    return find(tree, stratified_targets(tree, batch_size, rng))
