"""Arrays of agents (GALA's): a leading agent axis sharded over the devices of every process, each
device holding a block of consecutive agents (one agent or several that share it)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def agents_sharding(global_devices: list) -> NamedSharding:
    """The agents split into equal blocks of consecutive agents over `global_devices` (every
    process's, in order, each device once): block k on device k."""
    return NamedSharding(Mesh(np.array(global_devices), ("agents",)), PartitionSpec("agents"))


def sharded(tree, sharding: NamedSharding):
    """Host arrays with every agent on the leading axis, each device's block put on it."""
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), tree
    )


def agent_slice(tree, agent: int):
    """Agent `agent`'s row of `tree` (by its global index, one of this process's agents), on the
    device whose block holds it."""

    def row(x):
        for shard in x.addressable_shards:
            start, stop, _ = shard.index[0].indices(x.shape[0])
            if start <= agent < stop:
                return shard.data[agent - start]
        raise ValueError(f"agent {agent} is not on a device of this process")

    return jax.tree.map(row, tree)


def from_slices(slices: list, sharding: NamedSharding):
    """The array of every agent from this process's agents' slices (1, ...), in agent order, each
    already on its device: consecutive slices are joined into their device's block."""
    per_device = len(slices) // len(sharding.addressable_devices)
    blocks = [
        jnp.concatenate(slices[start : start + per_device])
        for start in range(0, len(slices), per_device)
    ]
    shape = (sharding.mesh.devices.size * per_device, *slices[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks)


def gathered_agents(tree):
    """Every agent's `tree` on the host, from every process (a collective)."""
    return multihost_utils.process_allgather(tree, tiled=True)
