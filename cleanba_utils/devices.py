"""Arrays on the learner devices: a copy per device (`replicate`), the first copy back
(`first_replica`), each device's share of a batch (`local_shares`, put there with
`learner_sharding`), and every process's rollouts in one array (`gathered`,
`gathered_rollouts`). A pmap'd learner takes its inputs with the devices on the leading axis."""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def learner_sharding(devices: list) -> NamedSharding:
    """Arrays split over `devices` along their leading axis, one slice each, as a pmap over them
    takes its inputs: `jax.device_put(tree, learner_sharding(devices))` copies each slice to its
    device in one call."""
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec("devices"))


def replicate(tree, devices: list):
    """One copy of `tree` per device, as a pmap over `devices` takes it (the leading axis)."""
    copies = jax.tree.map(lambda x: np.stack([np.asarray(x)] * len(devices)), tree)
    return jax.device_put(copies, learner_sharding(devices))


def first_replica(tree):
    """The copy held by this process's first learner device of a pmap'd (replicated) tree."""
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], tree)


def local_shares(tree, num_local: int, batch_axis: int = 0):
    """This process's learner devices' shares of batches, on a new leading axis: of every batch
    (its samples on `batch_axis`), global learner device d takes samples d x share .. (d + 1) x
    share - 1, where share = batch / (num_local x processes). So every layout trains on the same
    samples."""
    num_global = num_local * jax.process_count()
    local = slice(jax.process_index() * num_local, (jax.process_index() + 1) * num_local)

    def shares(v):
        split = v.reshape(*v.shape[:batch_axis], num_global, -1, *v.shape[batch_axis + 1 :])
        return np.moveaxis(split, batch_axis, 0)[local]

    return jax.tree.map(shares, tree)


def _as_words(value: np.ndarray) -> np.ndarray:
    """A 64-bit array as pairs of 32-bit words (a last axis of 2); any other as it is."""
    if value.dtype.itemsize != 8:
        return value
    return np.ascontiguousarray(value).view(np.uint32).reshape(*value.shape, 2)


def _from_words(words: np.ndarray, dtype) -> np.ndarray:
    if dtype.itemsize != 8:
        return words
    return np.ascontiguousarray(words).view(dtype).reshape(words.shape[:-1])


def gathered(tree, distributed: bool):
    """Every process's `tree` (environments on the leading axis), concatenated in process order:
    the whole run's environments, in global order, every leaf bit for bit. A collective: every
    process calls it."""
    if not distributed:
        return tree
    tree = jax.tree.map(np.asarray, tree)
    # JAX without 64-bit types would round 64-bit leaves (continuous PPO's float64 discounted
    # returns, a record's int64 counts) to 32 bits: they cross as pairs of 32-bit words.
    everyone = multihost_utils.process_allgather(jax.tree.map(_as_words, tree))
    merged = jax.tree.map(lambda v: np.asarray(v).reshape(-1, *v.shape[2:]), everyone)
    return jax.tree.map(lambda v, like: _from_words(v, like.dtype), merged, tree)


def gathered_rollouts(parts: list, distributed: bool):
    """This process's rollouts `parts` (pytrees of one structure, environments on the leading axis,
    in global env order) concatenated, then every process's (`gathered`): the whole run's
    environments in global order. A collective where `distributed`."""
    local = jax.tree.map(lambda *fields: np.concatenate(fields), *parts)
    return gathered(local, distributed)
