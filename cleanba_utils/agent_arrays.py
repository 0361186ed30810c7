"""Arrays of agents that each own a device (GALA's): a leading agent axis sharded over the devices
of every process, one agent's slice on each."""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def agents_sharding(global_devices: list) -> NamedSharding:
    """Agent i on device i of `global_devices` (every process's, in order)."""
    return NamedSharding(Mesh(np.array(global_devices), ("agents",)), PartitionSpec("agents"))


def sharded(tree, sharding: NamedSharding):
    """Host arrays with every agent on the leading axis, each agent's slice put on its device."""
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), tree
    )


def slice_on(tree, device):
    """The agent slice (1, ...) of `tree` on `device`: the array there, not a copy."""
    return jax.tree.map(
        lambda x: next(s.data[0] for s in x.addressable_shards if s.device == device), tree
    )


def from_slices(slices: list, sharding: NamedSharding):
    """The array of every agent from this process's agents' slices (1, ...), each on its device."""
    shape = (sharding.mesh.devices.size, *slices[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sharding, slices)


def gathered_agents(tree):
    """Every agent's `tree` on the host, from every process (a collective)."""
    return multihost_utils.process_allgather(tree, tiled=True)
