"""The command line of a training script: tyro's parser with one-line errors, the checks that every
script's `validate` and `validate_layout` share, and `check_fields`, which applies the checks
that fields declare (`fields`: `positive`, `non_negative`, `in_range`, `at_most`). A user's mistake
is one line on stderr and exit code 2, in the scripts and in the experiment tools alike
(`errors.fail`).

JAX, envpool and tyro are imported by the functions that use them: the experiment tools import
`fail` alone, and a launcher's dry run should not wait for their imports."""

import contextlib
import dataclasses
import io
import math
import os

from cleanba_utils.env_ids import ENV_ID_SCHEME, is_gymnasium_env, is_jax_env
from cleanba_utils.errors import fail
from cleanba_utils.fields import CHECK, Need


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def parse_args(args_type, argv=None):
    """tyro's parser, with its multi-line error box reduced to its one line of substance. From here
    on a stop signal ends the process quietly (`signals`), until the run acts on it itself. A run's
    options then ask XLA for deterministic GPU operations, before anything starts a JAX backend
    (`accelerators.request_deterministic_ops`)."""
    import tyro

    from cleanba_utils import signals

    signals.catch_stop_signals()
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = tyro.cli(args_type, args=argv)
    except SystemExit as exit_:
        if exit_.code:
            # The box's title, then its message (wrapped over lines) up to a rule of "─".
            lines = [line.strip(" │╭╮╰╯") for line in captured.getvalue().splitlines()]
            message = []
            for line in lines[1:]:
                if not line.strip("─"):
                    break
                message.append(line)
            fail(f"{' '.join(message) or 'invalid arguments'} (see --help)")
        print(captured.getvalue(), end="")
        raise
    from cleanba_utils.run_args import RunArgs

    if isinstance(args, RunArgs):
        from cleanba_utils.accelerators import request_deterministic_ops

        request_deterministic_ops(args.nondeterministic_gpu_ops)
    return args


def check_fields(args):
    """Every float option must be finite (NaN passes any comparison); then every field's declared
    `Check`, in the order of the fields."""
    for field in dataclasses.fields(args):
        value = getattr(args, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{flag(field.name)} must be a finite number, got {value}")
    for field in dataclasses.fields(args):
        check = field.metadata.get(CHECK)
        value = getattr(args, field.name)
        if check is not None and value is not None and not check.holds(value):
            fail(f"{flag(field.name)} {check.requirement}, got {value}")


def check_run_options(args):
    """The options every script has: the distributed run, envpool, the environment and the Hub
    repository of --upload-model."""
    distributed_options = [args.coordinator_address, args.num_processes, args.process_id]
    if any(o is not None for o in distributed_options) and not (
        args.distributed and all(o is not None for o in distributed_options)
    ):
        fail(
            "--coordinator-address, --num-processes and --process-id go together, "
            "with --distributed"
        )
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        fail(
            f"--process-id must be in 0 .. {args.num_processes - 1} (--num-processes), "
            f"got {args.process_id}"
        )
    check_env_id(args)
    if args.capture_video and is_gymnasium_env(args.env_id) and args.eval_episodes > 0:
        from cleanba_utils.gymnasium_envs import check_filmable

        check_filmable(args.env_id)
    env_splits = getattr(args, "env_splits", None)
    if env_splits and env_splits > 1 and is_jax_env(args.env_id):
        fail(
            f"--env-splits {env_splits} has no effect on a JAX environment: its steps run inside "
            "the actor's compiled rollout, with no envpool instance to step beside inference"
        )
    if env_splits and env_splits > args.local_num_envs:
        fail(
            f"--env-splits {env_splits} exceeds --local-num-envs {args.local_num_envs}: each split "
            "needs at least one environment"
        )
    if args.upload_model:
        from cleanba_utils.hub import check_repository

        check_repository(args)


def check_env_id(args):
    """--env-id names its source (`ENV_ID_SCHEME`): a JAX environment is loaded, its parameters
    set (--env-params) and its spaces read; a Gymnasium environment is made and its spaces read;
    an envpool id must be one of envpool's."""
    if is_jax_env(args.env_id):
        from cleanba_utils import jax_envs

        env = jax_envs.load_env(args.env_id, tuple(args.env_params))
        jax_envs.observation_space(env)
        jax_envs.action_space(env)
        return
    if is_gymnasium_env(args.env_id):
        from cleanba_utils import gymnasium_envs

        gymnasium_envs.spaces(args.env_id)
        return
    import envpool

    if args.env_id not in envpool.list_all_envs():
        fail(f"--env-id {args.env_id} is not an envpool environment; give {ENV_ID_SCHEME}")


def check_layers(args, names: list[str]):
    """A network's layer sizes, given by the options `names` together (an unset one, None, is the
    script's own choice): at least one layer, every size positive."""
    sizes = {name: tuple(getattr(args, name) or ()) for name in names}
    together = " and ".join(flag(name) for name in names)
    if not any(sizes.values()):
        fail(f"{together} {'are' if len(names) > 1 else 'is'} empty; give the network a layer")
    for name, layers in sizes.items():
        if any(size <= 0 for size in layers):
            fail(f"{flag(name)} takes positive layer sizes, got {' '.join(map(str, layers))}")


def observes_images(args) -> bool:
    from cleanba_utils.envs import has_image_observations

    return has_image_observations(args.env_id)


IMAGE_OBSERVATIONS = Need(observes_images, "an --env-id of image observations (Atari: Breakout-v5)")
"""What a CNN torso's options need."""


def default_of(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def shown(name: str, value) -> str:
    """An option as the user typed it: `--no-autotune`, `--channels 8 16`, `--alpha 0.1`."""
    if isinstance(value, bool):
        return flag(name) if value else f"--no-{name.replace('_', '-')}"
    if isinstance(value, tuple):
        return " ".join([flag(name), *map(str, value)])
    return f"{flag(name)} {value}"


def check_needs(args, needs: dict[str, Need]):
    """Refuses an option set away from its default where it would have no effect: `needs` maps an
    option to what it needs (a script's table). A user who sets an option and sees it ignored draws
    wrong conclusions from the run."""
    for field in dataclasses.fields(args):
        need = needs.get(field.name)
        value = getattr(args, field.name)
        if need is not None and value != default_of(field) and not need.holds(args):
            fail(f"{shown(field.name, value)} has no effect here: it acts only with {need.what}")


def check_continuous_actions(args):
    """For the continuous-control scripts: a task that envpool does not have, or whose actions are
    discrete (Atari, classic control), is refused, the latter with the scripts that train it."""
    from cleanba_utils.envs import is_continuous

    check_env_id(args)
    if not is_continuous(args.env_id):
        fail(
            f"--env-id {args.env_id} has discrete actions and this script acts in continuous "
            "ones; train it with cleanba/cleanba_ppo.py or cleanba/cleanba_apex_dqn.py"
        )


def check_discrete_actions(args):
    """For the scripts that choose among discrete actions: a task with continuous actions (MuJoCo,
    dm_control) is refused with the script that trains it."""
    from cleanba_utils.envs import is_continuous

    if is_continuous(args.env_id):
        fail(
            f"--env-id {args.env_id} has continuous actions and this script chooses among discrete "
            "ones; train it with cleanba/cleanba_ppo_continuous.py or cleanba/cleanba_sac.py"
        )


def check_devices(
    args,
    num_updates: int,
    steps_per_update: int,
    split_rollouts: bool = True,
    split_batches: bool = False,
):
    """The checks that need the devices and the number of processes, before any environment or
    device work. `split_rollouts`: each learner device takes a share of every rollout's
    environments (not so for a learner that trains on batches drawn from a replay);
    `split_batches`: each learner device of every process takes a share of every --batch-size
    batch (a learner that trains on batches drawn from a replay)."""
    import jax

    local_devices = jax.local_devices()
    num_devices = len(local_devices)
    for name in ["actor_device_ids", "learner_device_ids"]:
        ids = getattr(args, name)
        if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_devices for i in ids):
            fail(
                f"{flag(name)} must list distinct ids among the {num_devices} local devices "
                f"(0..{num_devices - 1}: {', '.join(map(str, local_devices))}), got {list(ids)}"
                f"{slurm_devices_given()}"
            )
    if split_rollouts and args.local_num_envs % len(args.learner_device_ids):
        fail(
            f"--local-num-envs {args.local_num_envs} must be divisible by the number of learner "
            f"devices ({len(args.learner_device_ids)}): each learner device takes an equal share "
            "of every rollout"
        )
    if num_updates < 1:
        fail(
            f"--total-timesteps {args.total_timesteps} is less than one rollout "
            f"({steps_per_update} steps = num envs x num steps); raise it or shrink "
            "--local-num-envs / --num-steps"
        )
    num_learner_devices = len(args.learner_device_ids) * jax.process_count()
    if split_batches and args.batch_size % num_learner_devices:
        fail(
            f"--batch-size {args.batch_size} must be divisible by the {num_learner_devices} "
            "learner device(s): each takes an equal share of every batch"
        )


def slurm_devices_given() -> str:
    """Under SLURM, what the task was given: its GPUs (CUDA_VISIBLE_DEVICES, which SLURM sets from
    the job's GPU request) and its GPUs per task; else nothing."""
    if "SLURM_JOB_ID" not in os.environ:
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "none")
    per_task = os.environ.get("SLURM_GPUS_PER_TASK", "not set")
    return (
        f"; this SLURM task (job {os.environ['SLURM_JOB_ID']}) was given the GPUs "
        f"CUDA_VISIBLE_DEVICES={visible} (--gpus-per-task {per_task}): request as many as the "
        "largest device id + 1 (the launcher's --slurm-gpus-per-task)"
    )


def available_memory() -> int | None:
    """Bytes of memory the kernel can give without swapping (MemAvailable), or None where it does
    not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")
            )
    except (OSError, StopIteration, ValueError):
        return None


def check_memory(args, name: str, needed_bytes: int, reserve_bytes: int):
    """Refuses a buffer of `needed_bytes`, sized by the option `name`, that would not fit in the
    available memory with `reserve_bytes` left for the rest of the process: one line now rather than
    a crash when it fills."""
    available = available_memory()
    value = getattr(args, name)
    if available is not None and needed_bytes + reserve_bytes > available:
        bytes_each = needed_bytes / value
        fits = max(0, int((available - reserve_bytes) / bytes_each))
        fail(
            f"{flag(name)} {value} needs {needed_bytes / 2**30:.1f} GiB ({bytes_each:.0f} bytes "
            f"each) but {available / 2**30:.1f} GiB of memory is available, "
            f"{reserve_bytes / 2**30:.0f} GiB of which is kept for the rest of the run; "
            f"lower {flag(name)} to at most {fits}"
        )
