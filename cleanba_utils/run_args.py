"""The options of a run that every script shares: naming and logging it, evaluating it, spreading it
over processes, checkpointing and resuming it. A script's `Args` extends `RunArgs` (or `DeviceArgs`,
which adds the devices of the actor threads and of the learner) with its algorithm's options, and
redeclares a field where its default or its meaning differs (the option keeps its place in
`--help`). A numeric field declares the check of its values (`fields.positive`, `non_negative`,
`in_range`, `at_most`); a redeclared field replaces the whole field, so it declares its check
again."""

import dataclasses
from typing import Literal

from cleanba_utils.env_ids import is_gymnasium_env, is_jax_env
from cleanba_utils.fields import Need, non_negative, positive


@dataclasses.dataclass
class RunArgs:
    exp_name: str = "cleanba"
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment: the environments and every random draw of the actors and the learner
    (initialization, actions, sampling)"""
    run_name: str | None = None
    """name of the run folder under `runs/` (default: `{env_id}__{exp_name}__{seed}__{unix time}`)
    """
    group: str = ""
    """free-form label of the experiment this run belongs to, recorded in spec.json"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project_name: str = "cleanba"
    """the Weights & Biases project"""
    wandb_entity: str | None = None
    """the Weights & Biases entity (team)"""
    save_model: bool = False
    """save the final parameters to `runs/{run_name}/{exp_name}.cleanba_model` (`python -m
    cleanba_utils.evaluate` plays it)"""
    upload_model: bool = False
    """with --save-model: at the end of the run, upload the model, spec.json, the evaluation's
    returns and a model card to the Hugging Face Hub repository
    `{hf_entity}/{env_id}-{exp_name}-seed{seed}` (docs/logging.md)"""
    hf_entity: str | None = None
    """the Hugging Face user or organization that --upload-model uploads to (default: the token's
    user)"""
    eval_episodes: int = non_negative(0)
    """play this many episodes with the script's evaluation policy (its `evaluate`) in environments
    of their own every --eval-every updates and after the last; their mean is logged as
    charts/eval_return (0: no evaluation)"""
    eval_every: int = non_negative(0)
    """evaluate every this many updates, and the untrained policy at step 0 (0: only after the
    last); evaluation never changes the run"""
    capture_video: bool = False
    """film the first episode of each evaluation (--eval-episodes) of a Gymnasium environment that
    renders rgb_array frames: `runs/{run_name}/videos/eval_{global step}.mp4`, and videos/eval in
    TensorBoard (which --track syncs to Weights & Biases); needs the video extra (moviepy)"""
    log_frequency: int = positive(10)
    """print and log losses every this many updates"""
    env_params: tuple[str, ...] = ()
    """a JAX environment's parameters (`gymnax:` or `jax:` --env-id), NAME=VALUE each: fields of
    its `EnvParams` (MinAtar: max_steps_in_episode=1000; Pendulum-v1: max_torque=2.0), recorded in
    spec.json"""
    vectorization_mode: Literal["sync", "async"] = "sync"
    """how a Gymnasium environment's copies (`gymnasium:` --env-id) step: one after another in the
    actor thread (sync: Gymnasium's SyncVectorEnv), or each in a worker process of its own (async:
    its AsyncVectorEnv, the workers started by forkserver, so a class of yours must be importable by
    its module's name). The default is measured in docs/gymnasium_environments.md; results do not
    depend on it"""
    envpool_num_threads: int | None = positive(None)
    """worker threads of each envpool instance (default: the CPUs shared equally among the
    instances); results do not depend on it"""
    nondeterministic_gpu_ops: bool = False
    """trade repeatability for speed on a GPU: let XLA pick its fastest kernels, whose sums run in
    whatever order the GPU's threads arrive, so the same command gives another result each run
    (default: `--xla_gpu_deterministic_ops=true` is added to XLA_FLAGS; docs/performance.md has its
    cost). Refused where JAX does not run on a GPU"""
    concurrency: bool = False
    """let actors collect the next rollout while the learner trains (policy lag 1 instead of 0)"""
    distributed: bool = False
    """join a multi-process run with jax.distributed (configured by SLURM or the three options
    below)"""
    coordinator_address: str | None = None
    """host:port of process 0, for --distributed outside SLURM"""
    num_processes: int | None = None
    """the number of processes, for --distributed outside SLURM"""
    process_id: int | None = None
    """this process's index in 0 .. num_processes - 1, for --distributed outside SLURM"""
    checkpoint_every: int = non_negative(0)
    """save a checkpoint every this many updates and after the last one (0: only on SIGTERM /
    SIGUSR1)"""
    resume: bool = False
    """continue from the newest readable checkpoint of `runs/{run_name}` (start fresh if there is
    none). SAC, continuous PPO and Ape-X DPG (on envpool's tasks and on Gymnasium's with a time
    limit), and every script on a JAX environment, then repeat the uninterrupted run; the other
    scripts start their environments anew from the run's seeds (docs/checkpoints.md: "What a
    resumed run is")"""


@dataclasses.dataclass
class DeviceArgs(RunArgs):
    actor_device_ids: tuple[int, ...] = (0,)
    """the local device ids that run actor threads"""
    learner_device_ids: tuple[int, ...] = (0,)
    """the local device ids the learner update is pmap'd over (each takes an equal share of every
    rollout or batch)"""


def observes_gymnasium_images(args) -> bool:
    from cleanba_utils.envs import has_image_observations

    return is_gymnasium_env(args.env_id) and has_image_observations(args.env_id)


GYMNASIUM_IMAGES = Need(
    observes_gymnasium_images,
    "a Gymnasium environment of image observations (--env-id gymnasium:...)",
)
"""What --frame-stack (the discrete scripts') needs."""


JAX_ENV = Need(
    lambda args: is_jax_env(args.env_id), "a JAX environment (--env-id gymnax:... or jax:...)"
)
"""What an option that acts on a JAX environment alone needs."""

GYMNASIUM_ENV = Need(
    lambda args: is_gymnasium_env(args.env_id), "a Gymnasium environment (--env-id gymnasium:...)"
)

# The options of `RunArgs` that act only with another one.
RUN_NEEDS = {
    "wandb_project_name": Need(lambda args: args.track, "--track"),
    "wandb_entity": Need(lambda args: args.track, "--track"),
    "upload_model": Need(lambda args: args.save_model, "--save-model"),
    "hf_entity": Need(lambda args: args.upload_model, "--upload-model"),
    "eval_every": Need(lambda args: args.eval_episodes > 0, "--eval-episodes"),
    "env_params": JAX_ENV,
    "vectorization_mode": GYMNASIUM_ENV,
    "capture_video": Need(
        lambda args: is_gymnasium_env(args.env_id) and args.eval_episodes > 0,
        "a Gymnasium environment (--env-id gymnasium:...) and --eval-episodes",
    ),
    "coordinator_address": Need(lambda args: args.distributed, "--distributed"),
    "num_processes": Need(lambda args: args.distributed, "--distributed"),
    "process_id": Need(lambda args: args.distributed, "--distributed"),
    "resume": Need(
        lambda args: args.run_name is not None,
        "--run-name, the run folder whose checkpoints to continue from",
    ),
}

# The options that `--resume` lets change: they leave the experiment the same. Every other option of
# a script's `Args` is compared with the checkpoint's record (`checkpoints.resume_from`).
RESUMABLE_CHANGES = frozenset(
    [
        # naming and logging the run: where its records go, not what it trains
        "exp_name",
        "run_name",
        "group",
        "track",
        "wandb_project_name",
        "wandb_entity",
        "log_frequency",
        "save_model",
        "upload_model",
        "hf_entity",
        # evaluation plays environments of its own and never changes the run
        "eval_episodes",
        "eval_every",
        "capture_video",
        # checkpoints save the run, they do not change it
        "checkpoint_every",
        "resume",
        # the layout over devices, threads and processes: the same data up to float rounding (the
        # README's "Reproducibility"); the global number of environments is compared as a size
        "actor_device_ids",
        "learner_device_ids",
        "num_actor_threads",
        "local_num_envs",
        "distributed",
        "coordinator_address",
        "num_processes",
        "process_id",
        # the same computation scheduled otherwise: envpool's workers, microbatches whose gradients
        # sum to the minibatch's, Ape-X's replay work in a background thread or not
        "envpool_num_threads",
        "vectorization_mode",
        "env_splits",
        # a GPU's kernels: the same computation, its sums in another order
        "nondeterministic_gpu_ops",
        "gradient_accumulation_steps",
        "pipeline",
    ]
)
