"""No option is silently ignored: every option of every script, set alone to a value other than its
default, either changes the parsed configuration or is refused with one line that names what it
needs; with that added, it is accepted. Parse level only (no device, no environment stepped).

What each option needs is written here from the scripts' behaviour (which code reads the option),
independently of the tables the scripts' validation reads."""

import dataclasses
import sys
import types
import typing
from pathlib import Path

import jax
import numpy as np
import pytest

from cleanba import (
    cleanba_apex_dpg,
    cleanba_apex_dqn,
    cleanba_gala_a2c,
    cleanba_impala,
    cleanba_ppo,
    cleanba_ppo_continuous,
    cleanba_sac,
)
from cleanba_utils import fields

# The worked example's module, which --capture-video's need names.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))

ATARI = ["--env-id", "Breakout-v5"]
TRACK = ["--track"]
DISTRIBUTED = ["--distributed", "--coordinator-address", "127.0.0.1:1"]
DISTRIBUTED += ["--num-processes", "1", "--process-id", "0"]
# Every script's options that act only with another one, and the options that make them act.
RUN_NEEDS = {
    "wandb_project_name": TRACK,
    "wandb_entity": TRACK,
    "coordinator_address": DISTRIBUTED,
    "num_processes": DISTRIBUTED,
    "process_id": DISTRIBUTED,
    "resume": ["--run-name", "a_run"],
    "upload_model": ["--save-model"],
    "hf_entity": ["--upload-model", "--save-model"],
}
# --env-params acts on a JAX environment's parameters; --vectorization-mode on a Gymnasium
# environment's; --capture-video films a Gymnasium environment's evaluations (the worked example
# renders); --frame-stack stacks a Gymnasium environment's images (the discrete scripts').
CORRIDOR = "gymnasium:gymnasium_corridor:Corridor"
DISCRETE_NEEDS = {
    **RUN_NEEDS,
    "env_params": ["--env-id", "gymnax:Breakout-MinAtar"],
    "vectorization_mode": ["--env-id", "gymnasium:CartPole-v1"],
    "capture_video": ["--env-id", CORRIDOR, "--eval-episodes", "1"],
    "frame_stack": ["--env-id", "gymnasium:test_gymnasium_envs:Blink"],
    "core_size": ["--core", "lstm"],
}
CONTINUOUS_NEEDS = {
    **RUN_NEEDS,
    "env_params": ["--env-id", "gymnax:Pendulum-v1"],
    "vectorization_mode": ["--env-id", "gymnasium:Pendulum-v1"],
    "capture_video": ["--env-id", f"{CORRIDOR.removesuffix('Corridor')}ContinuousCorridor"],
    "core_size": ["--core", "lstm"],
}
CONTINUOUS_NEEDS["capture_video"] += ["--eval-episodes", "1"]
SCRIPTS = {
    "ppo": (cleanba_ppo, {**DISCRETE_NEEDS, "eval_every": ["--eval-episodes", "2"]}),
    "impala": (cleanba_impala, {**DISCRETE_NEEDS, "eval_every": ["--eval-episodes", "2"]}),
    "apex_dqn": (
        cleanba_apex_dqn,
        {
            **DISCRETE_NEEDS,
            "eval_every": ["--eval-episodes", "2"],
            "checkpoint_replay": ["--env-id", "gymnax:Breakout-MinAtar"],
        },
    ),
    "gala_a2c": (
        cleanba_gala_a2c,
        {
            **DISCRETE_NEEDS,
            "eval_actions": ["--eval-episodes", "2"],
            "eval_every": ["--eval-episodes", "2"],
            "staleness_bound": ["--gossip", "async"],
        },
    ),
    "ppo_continuous": (
        cleanba_ppo_continuous,
        {**CONTINUOUS_NEEDS, "eval_every": ["--eval-episodes", "2"]},
    ),
    "sac": (
        cleanba_sac,
        {**CONTINUOUS_NEEDS, "eval_every": ["--eval-episodes", "2"], "alpha": ["--no-autotune"]},
    ),
    "apex_dpg": (
        cleanba_apex_dpg,
        {**CONTINUOUS_NEEDS, "eval_every": ["--eval-episodes", "2"]},
    ),
}
# Options that act at the defaults but not in another configuration: (configuration + option, the
# option refused, what the message must name).
REFUSED_ELSEWHERE = {
    "ppo": [(["--env-id", "CartPole-v1", "--channels", "8"], "--channels", "--env-id")],
    "impala": [(["--env-id", "CartPole-v1", "--channels", "8"], "--channels", "--env-id")],
    "apex_dqn": [
        (["--env-id", "CartPole-v1", "--channels", "8", "8", "8"], "--channels", "--env-id"),
        (["--env-id", "CartPole-v1", "--torso", "impala"], "--torso", "--env-id"),
        (
            ["--priority-exponent", "0", "--importance-sampling-exponent", "0.5"],
            "--importance-sampling-exponent",
            "--priority-exponent",
        ),
    ],
    "gala_a2c": [
        (["--env-id", "CartPole-v1", "--torso", "impala"], "--torso", "--env-id"),
        (["--topology", "allreduce", "--num-peers", "2"], "--num-peers", "--topology gossip"),
        (["--topology", "none", "--gossip", "async"], "--gossip", "--topology gossip"),
        (["--gossip", "async", "--similarity-every", "5"], "--similarity-every", "--gossip sync"),
        (
            ["--gossip", "async", "--eval-episodes", "2", "--eval-every", "5"],
            "--eval-every",
            "--gossip sync",
        ),
    ],
    "ppo_continuous": [],
    "sac": [(["--no-autotune", "--alpha-lr", "0.01"], "--alpha-lr", "--autotune")],
    "apex_dpg": [
        (
            ["--eviction", "fifo", "--eviction-exponent", "-0.2"],
            "--eviction-exponent",
            "--eviction prioritized",
        ),
        (
            ["--priority-exponent", "0", "--importance-sampling-exponent", "0.5"],
            "--importance-sampling-exponent",
            "--priority-exponent",
        ),
    ],
}
# Values for the options a generic rule cannot choose (names, ids, the task).
VALUES = {
    "exp_name": ["other_name"],
    "run_name": ["a_run"],
    "group": ["a_group"],
    "wandb_project_name": ["another_project"],
    "wandb_entity": ["a_team"],
    "hf_entity": ["a_team"],
    "coordinator_address": ["127.0.0.1:2"],
    "num_processes": ["1"],
    "process_id": ["0"],
    "actor_device_ids": ["1"],
    "learner_device_ids": ["1"],
    "envpool_num_threads": ["3"],
    "env_params": ["max_steps_in_episode=100"],
    # None in `Args`: the platform's value (`PLATFORM_DEFAULTS`).
    "env_splits": ["3"],
    "gradient_accumulation_steps": ["2"],
    "similarity_every": ["5"],
    "gamma": ["0.9"],
    # Ape-X DPG's optimizer steps per rollout are a multiple of its steps per call.
    "steps_per_call": ["4"],
    "updates_per_rollout": ["24"],
}
DISCRETE_TASK = ["Pong-v5"]
CONTINUOUS_TASK = ["Hopper-v4"]


def other_value(script, field: dataclasses.Field) -> list[str]:
    """A valid value other than the field's default, as command-line words."""
    default = script.Args.__dataclass_fields__[field.name].default
    if field.name == "env_id":
        return CONTINUOUS_TASK if default == "HalfCheetah-v4" else DISCRETE_TASK
    if field.name in VALUES:
        return VALUES[field.name]
    if typing.get_origin(field.type) is typing.Literal:
        return [next(choice for choice in typing.get_args(field.type) if choice != default)]
    if field.name == "channels" and default is None:
        return ["8", "16", "16"]
    # None in `Args`: the observations' value (`torsos.resolve_image_defaults`).
    if field.name == "hiddens" and default is None:
        return ["24"]
    if field.name == "torso" and default is None:
        return ["impala"]
    if isinstance(default, bool):
        return []
    if isinstance(default, tuple):
        return [str(max(1, size // 2)) for size in default]
    if isinstance(default, int):
        return [str(default + 1)]
    if isinstance(default, float):
        return [str(default / 2 if default else 0.1)]
    raise AssertionError(f"no rule for --{field.name} ({field.type}, default {default!r})")


def words_of(field: dataclasses.Field, value: list[str], default) -> list[str]:
    name = field.name.replace("_", "-")
    if isinstance(default, bool):
        return [f"--no-{name}" if default else f"--{name}"]
    return [f"--{name}", *value]


def parse(script, argv: list[str], capsys):
    """The parsed configuration, or the one line of a refusal (exit code 2)."""
    try:
        return script.parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 2, (argv, exit_.code)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        return lines[0]


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_every_option_acts_or_is_refused(name, capsys):
    script, needs = SCRIPTS[name]
    defaults = dataclasses.asdict(script.parse_args([]))
    for field in dataclasses.fields(script.Args):
        default = defaults[field.name]
        option = words_of(field, other_value(script, field), default)
        parsed = parse(script, option, capsys)
        if field.name in needs:
            assert isinstance(parsed, str), f"{option} is accepted without {needs[field.name]}"
            assert option[0] in parsed and needs[field.name][0] in parsed, parsed
            parsed = parse(script, [*needs[field.name], *option], capsys)
        assert not isinstance(parsed, str), f"{option} is refused: {parsed}"
        changed = {
            key for key, value in dataclasses.asdict(parsed).items() if value != defaults[key]
        }
        assert field.name in changed, f"{option} left the configuration as it was"


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_options_without_effect_elsewhere_are_refused(name, capsys):
    script, _ = SCRIPTS[name]
    for argv, refused, named in REFUSED_ELSEWHERE[name]:
        line = parse(script, argv, capsys)
        assert isinstance(line, str), f"{argv} is accepted"
        assert refused in line and named in line, line
        # Without the option the configuration is valid: the option is what was refused.
        assert not isinstance(parse(script, argv[: argv.index(refused)], capsys), str)


def conv_channels(script, argv: list[str]) -> list[int]:
    """The output channels of the image network's convolutions (their shapes only: nothing is
    computed)."""
    network = script.network_of(script.parse_args(argv), num_actions=4)
    frames = jax.ShapeDtypeStruct((1, 4, 84, 84), np.uint8)
    shapes = jax.eval_shape(network.init, jax.random.PRNGKey(0), frames)
    return [leaf.shape[3] for leaf in jax.tree.leaves(shapes) if leaf.ndim == 4]


@pytest.mark.parametrize("script", [cleanba_apex_dqn, cleanba_gala_a2c])
def test_channels_are_the_torso_convolutions_in_every_script(script):
    """--channels sets the output channels of the torso's convolutions with either torso, as in PPO
    and IMPALA (whose one torso is the IMPALA ResNet); unset, each torso has its paper's."""
    nature = conv_channels(script, ["--torso", "nature", "--channels", "8", "12", "16"])
    assert nature == [8, 12, 16]
    # Each ResNet stack: a convolution and two residual blocks of two, all of the stack's channels.
    impala = conv_channels(script, ["--torso", "impala", "--channels", "8", "12", "16"])
    assert sorted(impala) == [8] * 5 + [12] * 5 + [16] * 5
    assert conv_channels(script, ["--torso", "nature"]) == [32, 64, 64]
    assert sorted(conv_channels(script, ["--torso", "impala"])) == [16] * 5 + [32] * 10


# The numeric options of the scripts that declare no check on their field, each with what checks it
# instead. Every other numeric option declares its check (`fields.positive`, `non_negative`,
# `in_range`, `at_most`).
UNCHECKED_NUMBERS = {
    "seed": "none: any integer seeds a run",
    "num_processes": "parsing.check_run_options, with --process-id in 0 .. num processes - 1",
    "process_id": "parsing.check_run_options, in 0 .. --num-processes - 1",
    "actor_device_ids": "parsing.check_devices, against the local devices",
    "learner_device_ids": "parsing.check_devices, against the local devices",
    "channels": "parsing.check_layers, and torsos.check_torso_channels where a script has torsos",
    "hiddens": "parsing.check_layers",
    "critic_hiddens": "parsing.check_layers",
    "actor_hiddens": "parsing.check_layers",
    "num_peers": "GALA's validate, against --num-agents",
}


def number_types(annotation) -> set:
    """The number types an option's annotation holds: `int | None` and `tuple[int, ...]` hold int;
    bool and Literal are not numbers here."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, tuple):
        return set().union(*(number_types(a) for a in typing.get_args(annotation)))
    return {annotation} & {int, float}


def test_every_numeric_option_declares_its_check_or_says_what_checks_it():
    """A numeric option cannot go unchecked by omission: one that declares no check on its field
    must be in UNCHECKED_NUMBERS, with what checks it instead; an entry no script has, or one that
    also declares a check, is refused too."""
    unchecked_seen = set()
    for name, (script, _) in SCRIPTS.items():
        for field in dataclasses.fields(script.Args):
            if not number_types(field.type):
                continue
            declared = fields.CHECK in field.metadata
            if field.name in UNCHECKED_NUMBERS:
                assert not declared, f"{name}: --{field.name} is in UNCHECKED_NUMBERS and checked"
                unchecked_seen.add(field.name)
            else:
                assert declared, (
                    f"{name}: --{field.name} declares no check (fields.positive, non_negative, "
                    "in_range or at_most) and is not in UNCHECKED_NUMBERS"
                )
    assert unchecked_seen == set(UNCHECKED_NUMBERS), set(UNCHECKED_NUMBERS) - unchecked_seen
