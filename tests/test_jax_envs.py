"""JAX environments (`gymnax:` and `jax:` ids, cleanba_utils/jax_envs.py): the compiled rollout
plays what a plain Python loop over gymnax's own functions plays with the same actions, keys and
reset steps; bad ids, parameters and spaces are one line and exit 2; the continuous scripts resume a
JAX environment's run bitwise; the worked example of a researcher's own environment trains."""

import importlib
import types
from collections import deque

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PPO_LAYOUT_ATOL,
    PPO_LAYOUTS,
    REPO,
    assert_refused,
    fingerprint_of,
    max_abs_difference,
    ppo_params_by_layout,
    run_script,
    scalars,
)
from preempt import assert_a_resumed_run_is_the_whole_one

from cleanba_utils import compiled_rollout, jax_envs
from cleanba_utils.envs import make_env
from cleanba_utils.episodes import Episodes

NUM_STEPS = 24
ENV_OFFSET = 3
SEED = 5


class Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, key, value, step):
        self.scalars.append((key, float(value), step))


def episodes_of(writer, num_envs: int) -> Episodes:
    """A run's episodes (`RunLogs.episodes`) logged to `writer`."""
    return Episodes(writer, deque(maxlen=100), np.zeros(num_envs), np.zeros(num_envs, np.int64))


def act(params, obs, env_ids, step, step_input):
    """Actions of Breakout's 3 that depend on the observation, the step and the environment."""
    features = obs.reshape(obs.shape[0], -1).sum(axis=1).astype(jnp.int32)
    return (features + step + env_ids) % 3, ()


def key_at(env_seed: int, step: int):
    """The documented rule: environment i of an instance seeded s draws from PRNGKey(s + i) folded
    with the stream constant, then with the step (the first reset: step 2**32 - 1)."""
    key = jax.random.fold_in(jax.random.PRNGKey(env_seed), jax_envs.ENV_KEY_STREAM)
    return jax.random.fold_in(key, np.uint32(step % 2**32))


def plain_loop(env_seed: int, actions: np.ndarray, max_steps: int):
    """One environment of gymnax's Breakout-MinAtar stepped from Python with gymnax's own
    `reset_env`, `step_env` and `is_truncated`, envpool's reset step after every episode's end.
    Returns per step (obs acted on, reward, terminated, truncated, is_reset)."""
    env, params = gymnax.make("Breakout-MinAtar")
    params = params.replace(max_steps_in_episode=max_steps)
    obs, state = env.reset_env(key_at(env_seed, -1), params)
    played = []
    next_is_reset = False
    for step, action in enumerate(actions):
        step_key, reset_key = jax.random.split(key_at(env_seed, step))
        if next_is_reset:
            next_obs, state = env.reset_env(reset_key, params)
            reward, terminated, truncated = 0.0, False, False
        else:
            next_obs, state, reward, terminated, _ = env.step_env(
                step_key, state, int(action), params
            )
            truncated = bool(env.is_truncated(state, params))
        played.append(
            (np.transpose(np.asarray(obs), (2, 0, 1)), float(reward), bool(terminated), truncated)
        )
        played[-1] += (next_is_reset,)
        next_is_reset = bool(terminated) or truncated
        obs = next_obs
    return played


def test_the_compiled_rollout_plays_what_a_plain_loop_over_gymnax_plays():
    # Episodes capped at 10 steps: truncations and reset steps fall inside each rollout, besides
    # Breakout's own terminations.
    args = types.SimpleNamespace(
        env_id="gymnax:Breakout-MinAtar",
        env_params=("max_steps_in_episode=10",),
        seed=SEED,
        local_num_envs=3,
        num_steps=NUM_STEPS,
        envpool_num_threads=None,
        num_actor_threads=1,
        actor_device_ids=(0,),
    )
    writer = Writer()
    rollout = compiled_rollout.start(
        make_env,
        args,
        episodes=episodes_of(writer, 3),
        num_envs=8,
        env_offset=ENV_OFFSET,
        env_record=None,
        act=act,
    )
    plays = [rollout.play(None, update) for update in (1, 2)]
    steps = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *[p.steps for p in plays])
    for env in range(3):
        reference = plain_loop(SEED + ENV_OFFSET + env, steps.env_actions[env], max_steps=10)
        obs, rewards, terminated, truncated, is_reset = map(np.array, zip(*reference))
        np.testing.assert_array_equal(steps.obs[env], obs)
        np.testing.assert_array_equal(steps.rewards[env], rewards.astype(np.float32))
        np.testing.assert_array_equal(steps.terminations[env], terminated)
        np.testing.assert_array_equal(steps.truncations[env], truncated)
        np.testing.assert_array_equal(steps.is_reset[env], is_reset)
        assert truncated.any() and is_reset.any()
    # The actions are the policy's of the observations it was given, at the run's steps.
    expected = act(None, jnp.asarray(steps.obs.swapaxes(0, 1).reshape(-1, 4, 10, 10)), 0, 0, 0)
    features = np.asarray(expected[0]).reshape(2 * NUM_STEPS, 3).T
    env_ids = np.arange(ENV_OFFSET, ENV_OFFSET + 3)[:, None]
    np.testing.assert_array_equal(
        steps.env_actions, (features + np.arange(2 * NUM_STEPS) + env_ids) % 3
    )
    # Episodes logged are those of the reference: every ended episode's return.
    logged = [value for key, value, _ in writer.scalars if key == "charts/episodic_return"]
    ended = steps.terminations | steps.truncations
    assert len(logged) == ended.sum()


def test_the_numpy_interface_steps_as_the_compiled_rollout():
    envs = jax_envs.JaxVectorEnv("gymnax:Breakout-MinAtar", ("max_steps_in_episode=10",), 11, 2)
    obs, _ = envs.reset()
    actions = np.array([[1, 2], [0, 0], [2, 1]] * 5)
    reference = [plain_loop(11 + env, actions[:, env], max_steps=10) for env in range(2)]
    for step, action in enumerate(actions):
        np.testing.assert_array_equal(obs, np.stack([r[step][0] for r in reference]))
        obs, rewards, terminated, truncated, _ = envs.step(action)
        np.testing.assert_array_equal(terminated, [r[step][2] for r in reference])
        np.testing.assert_array_equal(truncated, [r[step][3] for r in reference])
        np.testing.assert_array_equal(rewards, np.float32([r[step][1] for r in reference]))


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("cleanba_ppo", ["--env-id", "gymnax:NoSuchGame"], "gymnax has no environment"),
        ("cleanba_ppo", ["--env-id", "jax:no_such_module:Env"], "cannot import"),
        ("cleanba_ppo", ["--env-id", "jax:json:JSONDecoder"], "gymnax's interface"),
        ("cleanba_ppo", ["--env-id", "jax:json"], "is not an import path"),
        ("cleanba_ppo", ["--env-id", "NoSuchGame-v5"], "is not an envpool environment"),
        (
            "cleanba_ppo",
            ["--env-id", "gymnax:Breakout-MinAtar", "--env-params", "speed=3"],
            "has no parameter speed",
        ),
        (
            "cleanba_ppo",
            ["--env-id", "gymnax:Breakout-MinAtar", "--env-params", "max_steps_in_episode=nan"],
            "is not a finite value",
        ),
        (
            "cleanba_ppo",
            ["--env-id", "gymnax:Breakout-MinAtar", "--env-params", "max_steps_in_episode"],
            "takes NAME=VALUE",
        ),
        ("cleanba_ppo", ["--env-id", "Breakout-v5", "--env-params", "a=1"], "has no effect"),
        (
            "cleanba_ppo",
            ["--env-id", "gymnax:CartPole-v1", "--env-splits", "2"],
            "has no effect on a JAX environment",
        ),
        ("cleanba_ppo", ["--env-id", "gymnax:Pendulum-v1"], "has continuous actions"),
        ("cleanba_sac", ["--env-id", "gymnax:Breakout-MinAtar"], "has discrete actions"),
        (
            "cleanba_apex_dqn",
            ["--env-id", "CartPole-v1", "--no-checkpoint-replay"],
            "has no effect",
        ),
    ],
)
def test_bad_ids_parameters_and_spaces_are_one_line_and_exit_2(capsys, script, args, message):
    # The checks run before any file is written (parse_args, then the devices' checks).
    assert_refused(importlib.import_module(f"cleanba.{script}"), args, message, capsys)


PENDULUM = ["--env-id", "gymnax:Pendulum-v1", "--local-num-envs", "2", "--log-frequency", "1"]
# Breakout's episodes end within a few dozen steps at first: stops fall within episodes and between
# them (a reset step pending).
BREAKOUT = [
    *["--env-id", "gymnax:Breakout-MinAtar", "--local-num-envs", "2", "--log-frequency", "1"],
    *["--num-actor-threads", "1", "--num-steps", "16", "--num-minibatches", "2"],
    *["--update-epochs", "1", "--gradient-accumulation-steps", "1", "--total-timesteps", "256"],
]
RESUMED = {
    "ppo": ("cleanba_ppo", BREAKOUT),
    "ppo --concurrency": ("cleanba_ppo", [*BREAKOUT, "--concurrency"]),
    "impala (--concurrency)": (
        "cleanba_impala",
        [*BREAKOUT[: BREAKOUT.index("--update-epochs")], "--total-timesteps", "256"],
    ),
    "sac --concurrency": (
        "cleanba_sac",
        [
            *PENDULUM,
            *["--num-steps", "25", "--total-timesteps", "600", "--learning-starts", "200"],
            *["--hiddens", "16", "16", "--batch-size", "16", "--buffer-size", "1000"],
            "--concurrency",
        ],
    ),
    "ppo_continuous": (
        "cleanba_ppo_continuous",
        [
            *PENDULUM,
            *["--num-steps", "50", "--total-timesteps", "800", "--num-minibatches", "2"],
            *["--update-epochs", "2"],
        ],
    ),
    "apex_dqn --concurrency": (
        "cleanba_apex_dqn",
        [
            *BREAKOUT[: BREAKOUT.index("--num-minibatches")],
            *["--hiddens", "16", "--total-timesteps", "512", "--learning-starts", "96"],
            *["--batch-size", "16", "--buffer-size", "256", "--updates-per-rollout", "2"],
            *["--target-update-period", "3"],
        ],
    ),
    "gala_a2c (--concurrency)": (
        "cleanba_gala_a2c",
        [
            *BREAKOUT[: BREAKOUT.index("--num-actor-threads")],
            *["--hiddens", "16", "--num-steps", "4", "--total-timesteps", "320"],
        ],
    ),
    "apex_dpg": (
        "cleanba_apex_dpg",
        [
            *PENDULUM,
            *["--num-steps", "25", "--total-timesteps", "600", "--learning-starts", "200"],
            *["--random-steps", "100", "--batch-size", "16", "--buffer-size", "1000"],
            *["--critic-hiddens", "16", "16", "--actor-hiddens", "16", "16"],
            "--checkpoint-replay",
        ],
    ),
}


# In the long checks (`-m long`): GALA's four agents' runs and Ape-X DQN's cost the README's test
# command about 30 s of a worker.
LONG_RESUMES = {"gala_a2c (--concurrency)", "apex_dqn --concurrency"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.long) if name in LONG_RESUMES else name
        for name in RESUMED
    ],
)
def test_a_resumed_run_on_a_jax_environment_is_the_uninterrupted_one(tmp_path, name):
    # The stop falls after update 5 of 8 to 16: within Pendulum's episodes of 200 steps, between
    # Breakout's; the checkpoint holds the environments' state whole.
    script, argv = RESUMED[name]
    assert_a_resumed_run_is_the_whole_one(tmp_path, script, argv, update=5)


def test_ppo_on_minatar_repeats_its_fingerprint(tmp_path):
    args = [
        *["--env-id", "gymnax:Breakout-MinAtar", "--local-num-envs", "4", "--num-steps", "16"],
        *["--num-actor-threads", "1", "--num-minibatches", "2", "--update-epochs", "1"],
        *["--gradient-accumulation-steps", "1", "--total-timesteps", "256"],
    ]
    fingerprints = [fingerprint_of(run_script("cleanba_ppo.py", args, tmp_path)) for _ in "ab"]
    assert fingerprints[0] == fingerprints[1]


def test_the_worked_example_of_a_researchers_own_environment_learns(tmp_path):
    """docs/jax_environments.md's command on docs/examples/corridor.py, shortened to 20k steps: the
    mean length of the last 100 episodes (from the first half of a corridor of 12 cells to its end,
    cut at 50 steps). Measured on this project's 2-core x86 CPU machine, 2026-11-29 (shared with
    other work), seeds 1..10: 9.45, 10.34, 11.08, 8.96, 9.73, 10.11, 9.06, 9.57, 9.89, 9.67; a
    frozen learner (learning rate 1e-12), seeds 1..10: 45.19, 44.17, 43.31, 43.83, 44.62, 44.05,
    46.46, 42.67, 45.37, 43.24. Threshold 25: 14 above the worst seed, 18 below the best frozen
    run."""
    page = (REPO / "docs" / "jax_environments.md").read_text()
    command = page[page.index("PYTHONPATH=docs/examples uv run python") :].split("```")[0]
    argv = command.replace("\\\n", " ").split()[4:]
    assert argv[0] == "cleanba/cleanba_ppo.py"
    steps = argv.index("--total-timesteps")
    argv = [
        *argv[1:steps],
        *argv[steps + 2 :],
        "--total-timesteps",
        "20000",
        "--run-name",
        "corridor",
    ]
    result = run_script(
        "cleanba_ppo.py",
        argv,
        tmp_path,
        extra_env={"PYTHONPATH": str(REPO / "docs" / "examples")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lengths = [
        value for _, value in scalars(tmp_path / "runs" / "corridor", "charts/episodic_length")
    ]
    assert np.mean(lengths[-100:]) < 25


# In the long checks (`-m long`): its runs cost the README's test command about 20 s.
@pytest.mark.long
def test_a_layout_changes_a_jax_environments_run_by_rounding_only(tmp_path):
    # Environment g's keys are (seed + g, step) whatever the thread or device that steps it: the
    # same data, and parameters equal up to the sums' rounding (PPO_LAYOUT_ATOL, as on envpool).
    args = [
        *["--env-id", "gymnax:Breakout-MinAtar", "--num-steps", "16"],
        *["--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "384"],
    ]
    params = ppo_params_by_layout(tmp_path, args, PPO_LAYOUTS)
    for name in ("two_learners", "two_threads"):
        assert max_abs_difference(params["one_learner"], params[name]) < PPO_LAYOUT_ATOL


def test_names_made_from_an_id_stay_valid_folder_and_repository_names():
    from cleanba_utils.env_ids import name_part
    from cleanba_utils.experiments.sweeps import trial_runs
    from cleanba_utils.hub import repository_name

    assert name_part("Breakout-v5") == "Breakout-v5"
    assert name_part("gymnax:Breakout-MinAtar") == "gymnax-Breakout-MinAtar"
    assert name_part("jax:my_pkg.envs:Grid/v1") == "jax-my_pkg.envs-Grid-v1"
    args = types.SimpleNamespace(env_id="jax:my_pkg.envs:Grid", exp_name="cleanba_ppo", seed=3)
    assert repository_name(args) == "jax-my_pkg.envs-Grid-cleanba_ppo-seed3"
    ((run_name, argv),) = trial_runs(
        ["python", "cleanba/cleanba_ppo.py"], ["gymnax:CartPole-v1"], [2], 0, [], "exp", False
    )
    assert run_name == "gymnax-CartPole-v1__exp__0__2"
    assert argv[argv.index("--env-id") + 1] == "gymnax:CartPole-v1"


@pytest.mark.parametrize("prob", [0.0, 0.3])
def test_sticky_actions_repeat_the_previous_action_at_their_rate(monkeypatch, prob):
    # docs/examples/corridor.py in a corridor of 32 cells: a step moves the walker one cell back or
    # forward as its action says, so where it moved (away from the walls) tells the action taken.
    # Where the policy's action differs from the action taken last, the step takes the last one
    # with probability `prob`: 4,000 such steps make the measured rate's standard error about 0.007.
    monkeypatch.syspath_prepend(str(REPO / "docs" / "examples"))
    settings = ("length=32", "max_steps_in_episode=100000", f"sticky_action_prob={prob}")
    envs = jax_envs.JaxVectorEnv("jax:corridor:Corridor", settings, seed=3, num_envs=64)
    position = envs.reset()[0].argmax(axis=1)
    rng = np.random.default_rng(0)
    last_taken = np.zeros(64, np.int64)
    known = np.zeros(64, bool)  # whether the action taken last is known
    different, repeated = 0, 0
    for _ in range(150):
        actions = rng.integers(0, 2, 64)
        obs, _, terminations, truncations, _ = envs.step(actions.astype(np.int32))
        moved = obs.argmax(axis=1) - position
        readable = (position > 0) & (position < 31) & ~terminations & ~truncations
        taken = (moved == 1).astype(np.int64)
        asked_other = known & readable & (actions != last_taken)
        different += asked_other.sum()
        repeated += (asked_other & (taken == last_taken)).sum()
        # Away from the walls the walker always moves: the step took an action.
        assert (np.abs(moved[readable]) == 1).all()
        last_taken = taken
        known = readable
        position = obs.argmax(axis=1)
    assert different > 4000
    assert abs(repeated / different - prob) < 0.03, (repeated, different)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("sticky_action_prob=1", "at least 0 and below 1"),
        ("sticky_action_prob=nan", "at least 0 and below 1"),
    ],
)
def test_bad_sticky_actions_are_one_line(capsys, setting, message):
    with pytest.raises(SystemExit) as exit_:
        jax_envs.load_env("gymnax:Breakout-MinAtar", (setting,))
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_sticky_actions_need_discrete_actions(capsys):
    with pytest.raises(SystemExit) as exit_:
        jax_envs.load_env("gymnax:Pendulum-v1", ("sticky_action_prob=0.1",))
    assert exit_.value.code == 2
    assert "has continuous actions" in capsys.readouterr().err
