"""What the library and its tools expect of a training script, by name: the module's names (the
tools call them, and the tests replace some: `TEST_REPLACEMENTS`) and the fields of its `Args`
that the library reads besides those of `RunArgs`. `tests/test_contract.py` checks every script
and the minimal example of docs/writing_a_script.md against them."""

from collections.abc import Callable
from typing import Protocol, runtime_checkable


@runtime_checkable
class Script(Protocol):
    """A training script's module."""

    Args: type
    """its options: a dataclass built on `run_args.RunArgs` with the fields of `ScriptArgs`"""
    parse_args: Callable
    """`parse_args(argv) -> Args`: the command line, checked (`validate`)"""
    validate: Callable
    """the checks that need no device (exit 2 on the first problem)"""
    validate_layout: Callable
    """the checks that need the devices or the number of processes"""
    make_env: Callable
    """`make_env(args, seed, num_envs)`: its environments (envpool's, or a JAX environment's),
    environment i seeded `seed + i`"""
    evaluate: Callable
    """`evaluate(params, args, num_episodes, seed) -> returns` (`RunEvaluations.evaluate`,
    `python -m cleanba_utils.evaluate`)"""
    init_state: Callable
    make_update: Callable
    main: Callable
    """`main(argv)`: the whole run (the launcher and the tests call it)"""
    open_run: Callable
    queue_get: Callable
    queue_put: Callable


@runtime_checkable
class ScriptArgs(Protocol):
    """The fields of a script's `Args` that the library reads by name besides `RunArgs`'s."""

    env_id: str
    total_timesteps: int
    local_num_envs: int
    """the environments of an actor thread (`handoff`, `parsing`)"""


@runtime_checkable
class ActorThreadArgs(ScriptArgs, Protocol):
    """What a script whose actor threads `handoff.start_actor_threads` starts with its default
    number of threads per device also has (`envs.make_env` reads the first two; a script with a
    fixed number of threads declares it as a `ClassVar`, or gives `threads_per_device`, as
    GALA-A2C's one thread per agent)."""

    num_actor_threads: int
    actor_device_ids: tuple[int, ...]
    learner_device_ids: tuple[int, ...]


TEST_REPLACEMENTS = {
    "make_env": "environments that fail at a chosen step, or record what they play",
    "open_run": "a run that receives a stop signal after a chosen update, or whose files fail",
    "make_update": "an update that fails, or runs out of device memory",
    "queue_get": "a hand-off that skips parameters, to show the lag a skip would give",
    "queue_put": "a hand-off that records what the actors send",
    "validate_layout": "a report of the devices the process sees, then its end (SLURM's GPUs)",
}
"""The module names the suite replaces in a script (`script.make_env = ...`), with what it puts in
their place: a script keeps them as module-level names, imported under these names."""
