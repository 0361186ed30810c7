"""Gymnasium environments as a source (`--env-id gymnasium:...`): the vector environment, in this
process and in worker processes, against a plain loop over single Gymnasium environments (seeds,
reset steps, ends, types), images channels first, environments brought back from their record, the
scripts' runs repeating their fingerprint, a resumed run of the continuous scripts against the
uninterrupted one, and bad ids and spaces refused with one line and exit 2."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
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
    wait_for_line,
)
from preempt import assert_a_resumed_run_is_the_whole_one

from cleanba_utils import env_records, gymnasium_envs


class Blink(gymnasium.Env):
    """An image environment for the tests (`gymnasium:test_gymnasium_envs:Blink`): a 5x4 RGB image
    whose pixels are the step count, episodes of 3 steps."""

    observation_space = gymnasium.spaces.Box(0, 255, (5, 4, 3), np.uint8)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.image(), {}

    def image(self):
        image = np.zeros((5, 4, 3), np.uint8)
        image[..., 0] = self.t
        image[0, 0, 1] = 7
        return image

    def step(self, action):
        self.t += 1
        return self.image(), float(action), self.t == 3, False, {}


class Listening(gymnasium.Env):
    """A Dict observation space, which the scripts do not take."""

    observation_space = gymnasium.spaces.Dict({"a": gymnasium.spaces.Discrete(2)})
    action_space = gymnasium.spaces.Discrete(2)


def plain_loop(env_id: str, seed: int, actions) -> list:
    """One Gymnasium environment stepped by hand, with envpool's reset step after each episode's end
    (the action ignored, the next episode's first observation, reward 0, no end): (observation
    acted on, reward, terminated, truncated, is_reset) per step."""
    env = gymnasium.make(env_id)
    obs, _ = env.reset(seed=seed)
    steps = []
    ended = False
    for action in actions:
        if ended:
            next_obs, _ = env.reset()
            steps.append((obs, 0.0, False, False, True))
            ended = False
        else:
            next_obs, reward, terminated, truncated, _ = env.step(int(action))
            steps.append((obs, reward, terminated, truncated, False))
            ended = terminated or truncated
        obs = next_obs
    return steps


@pytest.mark.parametrize("mode", gymnasium_envs.VECTORIZATION_MODES)
def test_the_vector_environment_plays_what_a_plain_loop_plays(mode):
    # CartPole's random episodes end within a few dozen steps: reset steps fall in the 300 steps;
    # env i is seeded seed + i as envpool's are.
    seed, num_envs = 7, 3
    actions = np.random.default_rng(0).integers(0, 2, (300, num_envs))
    envs = gymnasium_envs.GymnasiumVectorEnv("gymnasium:CartPole-v1", seed, num_envs, mode)
    obs, info = envs.reset()
    assert obs.dtype == np.float32 and info["env_id"].tolist() == [0, 1, 2]
    played = []
    is_reset = np.zeros(num_envs, bool)
    for step_actions in actions:
        envs.send(step_actions)
        next_obs, rewards, terminations, truncations, _ = envs.recv()
        assert rewards.dtype == np.float32 and terminations.dtype == bool
        played.append((obs, rewards, terminations, truncations, is_reset))
        is_reset = terminations | truncations
        obs = next_obs
    for env in range(num_envs):
        reference = plain_loop("CartPole-v1", seed + env, actions[:, env])
        for t, (ref, got) in enumerate(zip(reference, played)):
            np.testing.assert_array_equal(got[0][env], np.float32(ref[0]), err_msg=str(t))
            assert (got[1][env], got[2][env], got[3][env], got[4][env]) == (
                np.float32(ref[1]),
                ref[2],
                ref[3],
                ref[4],
            ), t
    assert sum(step[4].sum() for step in played) > 10  # reset steps were compared
    envs.close()


def random_steps_until_some_end(envs, record, rng, at_least: int):
    """Random actions, each step added to `record`, until a step at least `at_least` steps in that
    ends some environments' episodes and not the others': the record then holds episodes midway
    and episodes whose next step is a reset step. Returns the last observations and reset flags."""
    envs.reset()
    is_reset = np.zeros(envs.num_envs, bool)
    for step in range(10_000):
        actions = rng.uniform(-1, 1, (envs.num_envs, *envs.action_space.shape)).astype(np.float32)
        env_records.record_step(record, actions, is_reset)
        obs, _, terminations, truncations, _ = envs.step(actions)
        is_reset = terminations | truncations
        if step >= at_least and 0 < is_reset.sum() < envs.num_envs:
            return obs, is_reset
    raise AssertionError("no step ended some episodes and not the others")


@pytest.mark.parametrize("mode", gymnasium_envs.VECTORIZATION_MODES)
def test_mujoco_environments_brought_back_from_their_record_step_as_the_originals(mode):
    # Hopper's random episodes fall within a few dozen steps: after 100 steps each environment has
    # been reset several times, and the record's last step ends some episodes.
    env_id, seed, num_envs = "gymnasium:Hopper-v5", 5, 3
    rng = np.random.default_rng(1)
    envs = gymnasium_envs.GymnasiumVectorEnv(env_id, seed, num_envs, mode)
    record = env_records.empty_record(num_envs, env_id)
    obs, is_reset = random_steps_until_some_end(envs, record, rng, at_least=100)
    assert (record.resets >= 2).all()
    again = gymnasium_envs.GymnasiumVectorEnv(env_id, seed, num_envs, mode)
    replayed = []
    obs_again, is_reset_again = env_records.fast_forward(
        again, env_records.copy_of(record), on_step=lambda *step: replayed.append(step)
    )
    np.testing.assert_array_equal(obs_again, obs)
    np.testing.assert_array_equal(is_reset_again, is_reset)
    assert len(replayed) == record.episode_lengths.sum()
    for _ in range(60):
        actions = rng.uniform(-1, 1, (num_envs, 3)).astype(np.float32)
        for a, b in zip(envs.step(actions)[:4], again.step(actions)[:4]):
            np.testing.assert_array_equal(a, b)
    envs.close()
    again.close()


def test_an_environment_without_a_time_limit_keeps_no_record_and_is_made_anew():
    env_id = "gymnasium:test_gymnasium_envs:Blink"
    record = env_records.empty_record(2, env_id)
    assert not env_records.kept(record)
    env_records.record_step(record, np.ones((2, 1), np.float32), np.zeros(2, bool))
    envs = gymnasium_envs.GymnasiumVectorEnv(env_id, 0, 2)
    obs, is_reset = env_records.fast_forward(envs, record)
    np.testing.assert_array_equal(obs, envs.reset()[0])
    assert not is_reset.any()


def test_images_come_channels_first_and_keep_their_type():
    envs = gymnasium_envs.GymnasiumVectorEnv("gymnasium:test_gymnasium_envs:Blink", 0, 2)
    assert envs.observation_space.shape == (3, 5, 4)
    assert envs.observation_space.dtype == np.uint8
    assert envs.action_space == gymnasium.spaces.Discrete(2, dtype=np.int32)
    obs, _ = envs.reset()
    assert obs.shape == (2, 3, 5, 4) and obs.dtype == np.uint8
    obs = envs.step(np.array([1, 0]))[0]
    assert (obs[:, 0] == 1).all() and (obs[:, 1, 0, 0] == 7).all() and (obs[:, 1, 1:] == 0).all()


def test_stacked_images_are_the_last_images_channels_one_after_another():
    # Blink's red channel counts the steps (0, 1, 2, then a new episode): a stack of 3 holds the
    # last three images, the first repeated at a reset (Gymnasium's FrameStackObservation), each
    # image's 3 channels in turn.
    envs = gymnasium_envs.GymnasiumVectorEnv(
        "gymnasium:test_gymnasium_envs:Blink", 0, 2, frame_stack=3
    )
    assert envs.observation_space.shape == (9, 5, 4)
    obs, _ = envs.reset()
    assert obs.shape == (2, 9, 5, 4) and obs.dtype == np.uint8
    assert obs[0, ::3, 0, 1].tolist() == [0, 0, 0]
    assert (obs[:, 1::3, 0, 0] == 7).all()
    for _ in (1, 2):
        obs = envs.step(np.array([0, 0]))[0]
    assert obs[0, ::3, 0, 1].tolist() == [0, 1, 2]
    obs = envs.step(np.array([0, 0]))[0]  # the episode's last step (t = 3)
    assert obs[0, ::3, 0, 1].tolist() == [1, 2, 3]
    obs = envs.step(np.array([0, 0]))[0]  # the reset step
    assert obs[0, ::3, 0, 1].tolist() == [0, 0, 0]


# In the long checks (`-m long`): its run costs the README's test command about 10 s.
@pytest.mark.long
def test_a_script_takes_a_stack_of_a_gymnasium_environments_images(tmp_path):
    result = run_script(
        "cleanba_ppo.py",
        [
            *["--env-id", "gymnasium:test_gymnasium_envs:Blink", "--frame-stack", "4"],
            *["--channels", "4", "4", "4", "--hiddens", "8", "--local-num-envs", "2"],
            *["--num-actor-threads", "1", "--num-steps", "4", "--num-minibatches", "1"],
            *["--update-epochs", "1", "--total-timesteps", "16"],
        ],
        tmp_path,
        extra_env={"PYTHONPATH": str(REPO / "tests")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    spec = json.loads(next((tmp_path / "runs").glob("*/spec.json")).read_text())
    assert spec["args"]["frame_stack"] == 4
    # spec.json names the packages that make the environment: here a module on PYTHONPATH.
    assert spec["versions"]["test_gymnasium_envs"] == "not installed"
    assert spec["versions"]["gymnasium"] == gymnasium.__version__


def test_spec_json_records_the_mujoco_that_a_mujoco_task_runs_on():
    import importlib.metadata

    versions = gymnasium_envs.environment_versions("gymnasium:Hopper-v5")
    assert versions == {
        "gymnasium": gymnasium.__version__,
        "mujoco": importlib.metadata.version("mujoco"),
    }


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("cleanba_ppo", ["--env-id", "gymnasium:NoSuchGame-v0"], "Gymnasium cannot make it"),
        ("cleanba_ppo", ["--env-id", "gymnasium:no_such_module:Env"], "cannot import"),
        ("cleanba_ppo", ["--env-id", "gymnasium:json:JSONDecoder"], "not a gymnasium.Env"),
        (
            "cleanba_ppo",
            ["--env-id", "gymnasium:test_gymnasium_envs:Listening"],
            "FlattenObservation",
        ),
        ("cleanba_ppo", ["--env-id", "gymnasium:Pendulum-v1"], "has continuous actions"),
        ("cleanba_sac", ["--env-id", "gymnasium:CartPole-v1"], "has discrete actions"),
        ("cleanba_ppo", ["--env-id", "CartPole-v1", "--vectorization-mode", "async"], "no effect"),
        ("cleanba_ppo", ["--env-id", "gymnasium:CartPole-v1", "--capture-video"], "no effect"),
        ("cleanba_ppo", ["--env-id", "gymnasium:CartPole-v1", "--frame-stack", "4"], "no effect"),
        (
            "cleanba_ppo",
            [
                *["--env-id", "gymnasium:test_gymnasium_envs:Blink", "--capture-video"],
                *["--eval-episodes", "1"],
            ],
            "render_mode",
        ),
        ("cleanba_apex_dpg", ["--env-id", "gymnasium:CartPole-v1"], "has discrete actions"),
    ],
)
def test_bad_ids_and_spaces_are_one_line_and_exit_2(capsys, script, args, message):
    assert_refused(importlib.import_module(f"cleanba.{script}"), args, message, capsys)


SMALL = {
    "cleanba_ppo.py": [
        *["--hiddens", "16", "--local-num-envs", "4", "--num-actor-threads", "1"],
        *["--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "2"],
        *["--total-timesteps", "1024"],
    ],
    "cleanba_impala.py": [
        *["--hiddens", "16", "--local-num-envs", "4", "--num-actor-threads", "1"],
        *["--num-steps", "16", "--num-minibatches", "2", "--total-timesteps", "1024"],
    ],
    "cleanba_apex_dqn.py": [
        *["--hiddens", "16", "16", "--local-num-envs", "4", "--num-steps", "8"],
        *["--total-timesteps", "2048", "--learning-starts", "256", "--batch-size", "32"],
        *["--updates-per-rollout", "2", "--buffer-size", "4096"],
    ],
    "cleanba_gala_a2c.py": [
        *["--hiddens", "16", "--local-num-envs", "2", "--num-steps", "4"],
        *["--total-timesteps", "320"],
    ],
}
CONTINUOUS_SMALL = {
    "cleanba_ppo_continuous.py": [
        *["--hiddens", "16", "16", "--local-num-envs", "4", "--num-steps", "16"],
        *["--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "512"],
    ],
    "cleanba_sac.py": [
        *["--hiddens", "16", "16", "--local-num-envs", "4", "--num-steps", "16"],
        *["--total-timesteps", "512", "--learning-starts", "128", "--batch-size", "16"],
        *["--buffer-size", "1000"],
    ],
    "cleanba_apex_dpg.py": [
        *["--critic-hiddens", "16", "16", "--actor-hiddens", "16", "16", "--local-num-envs", "4"],
        *["--num-actor-threads", "1", "--num-steps", "8", "--total-timesteps", "512"],
        *["--learning-starts", "64", "--random-steps", "48", "--buffer-size", "256"],
        *["--batch-size", "16"],
    ],
}


# In the long checks (`-m long`): fourteen runs cost the README's test command about two minutes.
# The continuous scripts play the worked example's ContinuousCorridor, a researcher's own class.
@pytest.mark.long
@pytest.mark.parametrize("script", [*SMALL, *CONTINUOUS_SMALL])
def test_a_script_on_gymnasium_repeats_its_fingerprint(tmp_path, script):
    if script in SMALL:
        args = ["--env-id", "gymnasium:CartPole-v1", *SMALL[script]]
    else:
        corridor = "gymnasium:gymnasium_corridor:ContinuousCorridor"
        args = ["--env-id", corridor, *CONTINUOUS_SMALL[script]]
    fingerprints = []
    for run in range(2):
        result = run_script(
            script,
            [*args, "--run-name", f"run{run}"],
            tmp_path,
            extra_env={"PYTHONPATH": str(REPO / "docs" / "examples")},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        fingerprints.append(fingerprint_of(result))
    assert fingerprints[0] == fingerprints[1]


# In the long checks (`-m long`): four runs cost the README's test command about 40 s. With the
# fingerprint test above (the continuous scripts on ContinuousCorridor, the discrete ones on
# CartPole-v1) and the resume test (Hopper-v5), every script runs on a registered id and on the
# worked example.
@pytest.mark.long
@pytest.mark.parametrize("script", list(SMALL))
def test_a_discrete_script_trains_on_the_worked_example(tmp_path, script):
    result = run_script(
        script,
        ["--env-id", "gymnasium:gymnasium_corridor:Corridor", *SMALL[script]],
        tmp_path,
        extra_env={"PYTHONPATH": str(REPO / "docs" / "examples")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert scalars(next((tmp_path / "runs").iterdir()), "charts/episodic_return")


# In the long checks (`-m long`): its runs cost the README's test command about 20 s.
@pytest.mark.long
def test_a_layout_changes_a_gymnasium_environments_run_by_rounding_only(tmp_path):
    # Environment g is reset with seed + g whatever the thread that steps it: the same data, and
    # parameters equal up to the sums' rounding (PPO_LAYOUT_ATOL, as on envpool).
    args = [
        *["--env-id", "gymnasium:CartPole-v1", "--hiddens", "16", "--num-steps", "16"],
        *["--num-minibatches", "2", "--update-epochs", "2", "--total-timesteps", "768"],
    ]
    params = ppo_params_by_layout(tmp_path, args, PPO_LAYOUTS)
    for name in ("two_learners", "two_threads"):
        assert max_abs_difference(params["one_learner"], params[name]) < PPO_LAYOUT_ATOL
    # Another seed's parameters differ by far more: the tolerance tells a layout from another run.
    seed2 = {"seed2": [*PPO_LAYOUTS["one_learner"], "--seed", "2"]}
    other_seed = ppo_params_by_layout(tmp_path, args, seed2)["seed2"]
    assert max_abs_difference(params["one_learner"], other_seed) > 100 * PPO_LAYOUT_ATOL


# In the long checks (`-m long`): its run costs the README's test command about 15 s.
@pytest.mark.long
def test_the_worked_example_of_a_researchers_own_gymnasium_environment_learns(tmp_path):
    """docs/gymnasium_environments.md's command on docs/examples/gymnasium_corridor.py, shortened to
    20k steps: the mean length of the last 100 episodes (from the first half of a corridor of 12
    cells to its end, cut at 50 steps). Measured on this project's 2-core x86 CPU machine,
    2026-11-29 (shared with other work), seeds 1..10: 9.99, 9.29, 9.77, 9.68, 9.41, 9.16, 9.70,
    9.70, 10.13, 9.77; a frozen learner (learning rate 1e-12), seeds 1..10: 45.65, 42.66, 42.68,
    42.95, 43.29, 43.88, 44.99, 42.21, 44.19, 42.62. Threshold 25: 15 above the worst seed, 17 below
    the best frozen run."""
    lengths = worked_example_lengths(tmp_path, "cleanba/cleanba_ppo.py")
    assert np.mean(lengths[-100:]) < 25


# In the long checks (`-m long`): its run costs the README's test command about 15 s.
@pytest.mark.long
def test_the_continuous_worked_example_learns(tmp_path):
    """docs/gymnasium_environments.md's continuous PPO command on ContinuousCorridor, shortened to
    20k steps: the mean length of the last 100 episodes. Measured on this project's 2-core x86 CPU
    machine, 2026-11-29 (shared with other work), seeds 1..10: 10.67, 11.90, 10.50, 11.77, 10.42,
    11.17, 11.52, 11.65, 10.48, 11.29; a frozen learner (learning rate 1e-12), seeds 1..10: 43.50,
    44.32, 43.77, 43.56, 43.81, 41.13, 42.82, 43.58, 42.92, 42.75. Threshold 25: 13 above the worst
    seed, 16 below the best frozen run."""
    lengths = worked_example_lengths(tmp_path, "cleanba/cleanba_ppo_continuous.py")
    assert np.mean(lengths[-100:]) < 25


def worked_example_lengths(tmp_path, script: str) -> list[float]:
    """The episodes' lengths of docs/gymnasium_environments.md's command of `script`, shortened to
    20k steps."""
    page = (REPO / "docs" / "gymnasium_environments.md").read_text()
    block = page[page.index("PYTHONPATH=docs/examples uv run python") :].split("```")[0]
    commands = [line.split()[4:] for line in block.replace("\\\n", " ").splitlines() if line]
    (argv,) = [command for command in commands if command[0] == script]
    steps = argv.index("--total-timesteps")
    argv = [*argv[1:steps], *argv[steps + 2 :], "--total-timesteps", "20000"]
    result = run_script(
        Path(script).name,
        [*argv, "--run-name", "corridor"],
        tmp_path,
        extra_env={"PYTHONPATH": str(REPO / "docs" / "examples")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [value for _, value in scalars(tmp_path / "runs" / "corridor", "charts/episodic_length")]


class Unseeded(gymnasium.Env):
    """Draws from NumPy's global generator, not from `self.np_random`: the same seed gives other
    observations, which Gymnasium's checker finds."""

    observation_space = gymnasium.spaces.Box(0.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.random.random(2).astype(np.float32), {}

    def step(self, action):
        return np.random.random(2).astype(np.float32), 0.0, False, False, {}


def test_an_own_class_that_ignores_its_seed_is_one_line(capsys):
    assert_refused(
        importlib.import_module("cleanba.cleanba_ppo"),
        ["--env-id", "gymnasium:test_gymnasium_envs:Unseeded"],
        "environment checker",
        capsys,
    )


HOPPER = ["--env-id", "gymnasium:Hopper-v5", "--local-num-envs", "2", "--log-frequency", "1"]
RESUMED = {
    "ppo_continuous": (
        "cleanba_ppo_continuous",
        [
            *HOPPER,
            *["--num-steps", "40", "--total-timesteps", "640", "--num-minibatches", "2"],
            *["--update-epochs", "2", "--hiddens", "16", "16"],
        ],
    ),
    "sac --concurrency": (
        "cleanba_sac",
        [
            *HOPPER,
            *["--num-steps", "25", "--total-timesteps", "500", "--learning-starts", "150"],
            *["--hiddens", "16", "16", "--batch-size", "16", "--buffer-size", "1000"],
            "--concurrency",
        ],
    ),
    "apex_dpg": (
        "cleanba_apex_dpg",
        [
            *HOPPER,
            *["--num-steps", "25", "--total-timesteps", "600", "--learning-starts", "200"],
            *["--random-steps", "100", "--batch-size", "16", "--buffer-size", "1000"],
            *["--critic-hiddens", "16", "16", "--actor-hiddens", "16", "16"],
            "--checkpoint-replay",
        ],
    ),
}


# In the long checks (`-m long`): the three scripts' runs cost the README's test command about 45 s
# of a worker.
@pytest.mark.long
@pytest.mark.parametrize("name", list(RESUMED))
def test_a_resumed_run_on_gymnasiums_mujoco_is_the_uninterrupted_one(tmp_path, name):
    # Hopper's random episodes last a few dozen steps: at the stop (after update 5 of 8 to 10) each
    # environment has been reset and is midway through an episode or about to reset. The
    # checkpoint's record brings them back: their resets and current episodes replayed.
    script, argv = RESUMED[name]
    assert_a_resumed_run_is_the_whole_one(tmp_path, script, argv, update=5)


# In the long checks (`-m long`): its two runs cost the README's test command about 15 s.
@pytest.mark.long
def test_capture_video_films_the_first_evaluation_episode_and_changes_nothing(tmp_path):
    # The worked example renders its corridor: each evaluation's first episode becomes an mp4 and a
    # TensorBoard video; the run's parameters are those of the run without films.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = [
        *["--env-id", "gymnasium:gymnasium_corridor:Corridor", "--hiddens", "16"],
        *["--local-num-envs", "4", "--num-actor-threads", "1", "--num-steps", "16"],
        *["--num-minibatches", "2", "--update-epochs", "1", "--total-timesteps", "256"],
        *["--eval-episodes", "2", "--eval-every", "2"],
    ]
    examples = {"PYTHONPATH": str(REPO / "docs" / "examples")}
    filmed = run_script(
        "cleanba_ppo.py",
        [*args, "--capture-video", "--run-name", "filmed"],
        tmp_path,
        extra_env=examples,
    )
    assert filmed.returncode == 0, filmed.stderr[-3000:]
    plain = run_script(
        "cleanba_ppo.py", [*args, "--run-name", "plain"], tmp_path, extra_env=examples
    )
    assert fingerprint_of(filmed) == fingerprint_of(plain)
    films = sorted((tmp_path / "runs" / "filmed" / "videos").glob("*.mp4"))
    # Evaluations at steps 0, 128 and 256 (4 updates of 64 steps, every 2 updates).
    assert [f.name for f in films] == [f"eval_{step:012d}.mp4" for step in (0, 128, 256)]
    assert all(f.stat().st_size > 0 for f in films)
    events = EventAccumulator(str(tmp_path / "runs" / "filmed"), size_guidance={"images": 0})
    events.Reload()
    assert [video.step for video in events.Images("videos/eval")] == [0, 128, 256]


def living_processes_of_group(group: int) -> list[str]:
    """The command lines of the processes of process group `group` that have not ended (zombies
    apart), read from /proc."""
    living = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            living.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return living


def stopped_with_its_workers(tmp_path, signum: int) -> tuple[subprocess.Popen, str, float]:
    """PPO on CartPole-v1 in async mode, in a process group of its own, sent `signum` to the whole
    group (a terminal's Ctrl-C, SLURM's signal to every process of a job step) after its first
    progress line: the process, its stderr, and the seconds from the signal to its end."""
    args = [*SMALL["cleanba_ppo.py"], "--total-timesteps", "10000000"]
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "cleanba" / "cleanba_ppo.py"),
                *["--env-id", "gymnasium:CartPole-v1", "--vectorization-mode", "async"],
                *[*args, "--run-name", "stopped"],
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
        )
        wait_for_line(proc, "update ")
        sent_at = time.time()
        os.killpg(proc.pid, signum)
        proc.communicate(timeout=60)
    return proc, (tmp_path / "stderr.txt").read_text(), time.time() - sent_at


# In the long checks (`-m long`): two runs of about 20 s each.
@pytest.mark.long
@pytest.mark.parametrize(
    "signum,exit_code,message",
    [
        (signal.SIGINT, 130, "interrupted: stopped"),
        (signal.SIGTERM, 143, "checkpoint saved, continue with --resume"),
    ],
)
def test_a_stop_signal_to_the_workers_too_ends_the_run_and_them_cleanly(
    tmp_path, signum, exit_code, message
):
    # The workers ignore the signal; the run's process acts on it as without workers, then kills
    # them: no worker's traceback, no leaked semaphore, no worker left.
    proc, stderr, seconds = stopped_with_its_workers(tmp_path, signum)
    assert proc.returncode == exit_code, stderr[-3000:]
    assert message in stderr
    assert "Traceback" not in stderr and "Error" not in stderr and "leaked" not in stderr, stderr
    assert seconds < 10
    deadline = time.time() + 5
    while living_processes_of_group(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not living_processes_of_group(proc.pid)
