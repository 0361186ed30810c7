"""Arrays of agents (GALA's): a leading agent axis sharded over the devices of every process, each
device holding a block of consecutive agents (one agent or several that share it). Where the agents
go (`agent_devices_of`), how their arrays are put there and read back, and the collectives over
the agents inside a `shard_map` over their devices (`ring_shift`, `agents_mean`): the placement,
apart from the algorithm, whose gossip step the script writes."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cleanba_utils import distributed


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


class AgentDevices(NamedTuple):
    local: list
    """the device of each of this process's agents, in agent order"""
    every: list
    """the devices that hold agents, every process's in order, each once: device k holds the k-th
    block of consecutive agents"""


def agent_devices_of(num_agents: int) -> AgentDevices:
    """Each process's agents in equal blocks over its first d devices, d the most that divide them
    and that every process has."""
    local_agents = num_agents // jax.process_count()
    fewest = min(len(jax.local_devices(process_index=p)) for p in range(jax.process_count()))
    num_devices = max(d for d in range(1, fewest + 1) if local_agents % d == 0)
    block = local_agents // num_devices
    return AgentDevices(
        local=[jax.local_devices()[agent // block] for agent in range(local_agents)],
        every=distributed.global_learner_devices(range(num_devices)),
    )


def ring_shift(tree, distance: int):
    """Inside a `shard_map` over the mesh axis "agents" whose devices hold blocks of consecutive
    agents (a leading axis): agent j's rows of `tree` go to agent j + distance (mod the agents).
    Whole blocks move distance // block devices on; then the last distance % block agents of each
    block move to the front of the next device's block. With one agent per device, one
    `ppermute`."""
    num_devices = jax.lax.axis_size("agents")

    def device_shift(x, hops):
        pairs = [(p, (p + hops) % num_devices) for p in range(num_devices)]
        return jax.lax.ppermute(x, "agents", pairs)

    def shift(x):
        block = x.shape[0]
        hops, rest = divmod(distance, block)
        x = device_shift(x, hops)
        if rest == 0:
            return x
        return jnp.concatenate([device_shift(x[block - rest :], 1), x[: block - rest]])

    return jax.tree.map(shift, tree)


def agents_mean(tree):
    """Inside a `shard_map` over the mesh axis "agents": the mean over every agent of `tree`, whose
    leading axis is this device's block of agents."""
    return jax.lax.pmean(jax.tree.map(lambda x: x.mean(0), tree), "agents")
