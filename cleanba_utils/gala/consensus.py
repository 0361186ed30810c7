"""How far agents that train separate copies of one network (GALA's) are from agreeing: the
distances of their parameters to their average."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Consensus(NamedTuple):
    """Of the agents' parameters: each one's distance ‖x_i - x̄‖, their RMS and maximum (the radius
    of the ε-ball around x̄), its share of ‖x̄‖, and the largest difference of a parameter between
    agents (0: all the same)."""

    distances: jax.Array
    distance: jax.Array
    distance_max: jax.Array
    share: jax.Array
    spread: jax.Array


def consensus_of(stacked) -> Consensus:
    """`stacked`: the agents' parameters on a leading axis."""
    leaves = [x.reshape(x.shape[0], -1) for x in jax.tree.leaves(stacked)]
    squared = sum(jnp.sum((x - x.mean(0)) ** 2, axis=1) for x in leaves)
    mean_norm = jnp.sqrt(sum(jnp.sum(x.mean(0) ** 2) for x in leaves))
    distances = jnp.sqrt(squared)
    spread = jnp.max(jnp.stack([jnp.max(x.max(0) - x.min(0)) for x in leaves]))
    return Consensus(
        distances=distances,
        distance=jnp.sqrt(squared.mean()),
        distance_max=distances.max(),
        share=distances.max() / mean_norm,
        spread=spread,
    )


def consensus_stats(consensus: Consensus) -> dict:
    """The measures logged under stats/ (each agent's distance is logged on its own)."""
    return dict(
        consensus_distance=consensus.distance,
        consensus_distance_max=consensus.distance_max,
        consensus_share=consensus.share,
        consensus_spread=consensus.spread,
    )


def consensus_line(consensus: Consensus) -> str:
    """The console's: the radius of the ball around the average, and its share of its norm."""
    return f"consensus distance={consensus.distance_max:.3g} share={consensus.share:.3g}"
