"""cleanba_sac.py: the squashed Gaussian, the losses and the replay against hand computations and
NumPy, the update's grouping into calls, then short Hopper runs in two processes (2 CPU devices) for
the policy lag, the stored transitions, determinism, layout invariance, evaluation and resume."""

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import types

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PROMPT_EXIT_SECONDS,
    REPO,
    assert_policy_lag,
    assert_refused,
    flatten,
    load_params,
    max_abs_difference,
    run_failing,
    run_script,
    scalar_tags,
    scalars,
    seconds_after_failure,
    wait_for_line,
)
from preempt import assert_resumed_as_uninterrupted

from cleanba import cleanba_sac as sac
from cleanba_utils import env_records
from cleanba_utils.devices import gathered_rollouts, local_shares, replicate


def test_squashed_gaussian_log_prob_hand_computed():
    # Action box [-1.5, 2.5] (scale 2, bias 0.5) in dimension 0, [-1, 1] in dimension 1.
    bounds = sac.Bounds(scale=jnp.array([2.0, 1.0]), bias=jnp.array([0.5, 0.0]))
    mean = jnp.array([[0.3, -0.2]])
    log_std = jnp.array([[math.log(0.5), 0.0]])
    noise = jnp.array([[1.2, -0.7]])
    action, log_prob = sac.squashed_gaussian(mean, log_std, noise, bounds)
    # u = mean + std * noise; a = scale tanh(u) + bias; log p(a) = log N(u; mean, std) - log(scale
    # (1 - tanh(u)^2)) in each dimension (+1e-6 inside the log).
    expected_action = []
    expected = 0.0
    for m, s, z, scale, bias in [(0.3, 0.5, 1.2, 2.0, 0.5), (-0.2, 1.0, -0.7, 1.0, 0.0)]:
        u = m + s * z
        expected_action.append(scale * math.tanh(u) + bias)
        normal = math.exp(-0.5 * ((u - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
        expected += math.log(normal) - math.log(scale * (1 - math.tanh(u) ** 2) + 1e-6)
    np.testing.assert_allclose(action[0], expected_action, rtol=1e-6)
    np.testing.assert_allclose(log_prob, [expected], rtol=1e-5)


def test_squashed_gaussian_density_integrates_to_one_over_the_action_box():
    # One dimension, box [-3, 1]: exp(log p(a)) over a grid of pre-squashing values, integrated
    # over the actions they map to.
    bounds = sac.Bounds(scale=jnp.array([2.0]), bias=jnp.array([-1.0]))
    mean = 0.4
    std = 0.8
    noise = jnp.linspace(-7.0, 7.0, 200_001)[:, None]
    action, log_prob = sac.squashed_gaussian(
        jnp.full_like(noise, mean), jnp.full_like(noise, math.log(std)), noise, bounds
    )
    action = np.asarray(action[:, 0], np.float64)
    density = np.exp(np.asarray(log_prob, np.float64))
    assert -3.0 <= action.min() and action.max() <= 1.0
    assert abs(np.trapezoid(density, action) - 1.0) < 2e-3


def test_actor_log_std_stays_in_its_bounds():
    actor = sac.Actor((8,), 2)
    params = actor.init(jax.random.PRNGKey(0), jnp.zeros((1, 3)))
    # Scaled-up weights push the raw log std far out; the rescaled tanh keeps it in [-5, 2].
    params = jax.tree.map(lambda x: 100.0 * x, params)
    _, log_std = actor.apply(params, jax.random.normal(jax.random.PRNGKey(1), (64, 3)))
    assert float(log_std.min()) >= sac.LOG_STD_MIN and float(log_std.max()) <= sac.LOG_STD_MAX
    assert float(log_std.min()) < -4.9 and float(log_std.max()) > 1.9


def numpy_squash(mean, log_std, noise, scale, bias):
    u = mean + np.exp(log_std) * noise
    action = np.tanh(u) * scale + bias
    log_normal = -0.5 * noise**2 - log_std - 0.5 * np.log(2 * np.pi)
    return action, (log_normal - np.log(scale * (1 - np.tanh(u) ** 2) + 1e-6)).sum(-1)


def test_losses_match_a_numpy_reference():
    rng = np.random.default_rng(0)
    size = 5
    batch = sac.Batch(
        obs=rng.normal(size=(size, 3)).astype(np.float32),
        actions=rng.uniform(-1, 1, (size, 2)).astype(np.float32),
        rewards=rng.normal(size=size).astype(np.float32),
        next_obs=rng.normal(size=(size, 3)).astype(np.float32),
        terminations=np.array([0, 1, 0, 0, 1], np.float32),
    )
    next_q = rng.normal(size=(2, size)).astype(np.float32)
    next_log_prob = rng.normal(size=size).astype(np.float32)
    alpha = 0.3
    gamma = 0.9
    target = sac.soft_target(
        batch, next_q_target=next_q, next_log_prob=next_log_prob, alpha=alpha, gamma=gamma
    )
    expected_target = [
        batch.rewards[i]
        + gamma
        * (1 - batch.terminations[i])
        * (min(next_q[0, i], next_q[1, i]) - alpha * next_log_prob[i])
        for i in range(size)
    ]
    np.testing.assert_allclose(target, expected_target, rtol=1e-5)

    q_values = rng.normal(size=(2, size)).astype(np.float32)
    loss, (per_critic, mean_q) = sac.critic_loss(None, lambda p, o, a: q_values, batch, target)
    expected_losses = ((q_values - np.asarray(expected_target)) ** 2).mean(axis=1)
    np.testing.assert_allclose(per_critic, expected_losses, rtol=1e-5)
    np.testing.assert_allclose(loss, expected_losses.sum(), rtol=1e-5)
    np.testing.assert_allclose(mean_q, q_values.mean(axis=1), rtol=1e-6)

    # The actor's loss, with a linear "actor" and a critic that scores the action it is given.
    scale = np.array([1.5, 0.5], np.float32)
    bias = np.array([0.2, 0.0], np.float32)
    actor_weights = rng.normal(size=(3, 4)).astype(np.float32)
    critic_weights = rng.normal(size=(2, 2)).astype(np.float32)
    networks = sac.Networks(
        actor=types.SimpleNamespace(
            apply=lambda p, obs: (obs @ p[:, :2], jnp.tanh(obs @ p[:, 2:]) - 1.0)
        ),
        critic=types.SimpleNamespace(apply=lambda p, obs, actions: p @ actions.T),
        bounds=sac.Bounds(scale=scale, bias=bias),
    )
    noise = rng.normal(size=(size, 2)).astype(np.float32)
    loss = sac.actor_loss(
        actor_weights,
        networks=networks,
        critic_params=critic_weights,
        batch=batch,
        noise=noise,
        alpha=alpha,
    )
    mean = batch.obs @ actor_weights[:, :2]
    log_std = np.tanh(batch.obs @ actor_weights[:, 2:]) - 1.0
    actions, expected_log_prob = numpy_squash(mean, log_std, noise, scale, bias)
    q_pi = critic_weights @ actions.T
    np.testing.assert_allclose(
        loss, (alpha * expected_log_prob - q_pi.min(axis=0)).mean(), rtol=1e-4, atol=1e-5
    )

    # The temperature: -alpha (log pi + target entropy), and its gradient's sign: a policy less
    # random than the target (log pi above |A|) makes alpha grow (a negative gradient on log
    # alpha).
    log_alpha = np.float32(math.log(alpha))
    loss = sac.temperature_loss(log_alpha, next_log_prob, target_entropy=-2.0)
    np.testing.assert_allclose(loss, (-alpha * (next_log_prob - 2.0)).mean(), rtol=1e-5)
    sure = jax.grad(sac.temperature_loss)(log_alpha, jnp.full(size, 3.0), -2.0)
    unsure = jax.grad(sac.temperature_loss)(log_alpha, jnp.full(size, 1.0), -2.0)
    assert sure < 0 < unsure


def rollout_of(rng, env_ids, num_steps, obs_size=3):
    """A rollout of `len(env_ids)` environments whose observations name their environment and step,
    with reset steps."""
    num_envs = len(env_ids)
    obs = np.asarray(env_ids, np.float32)[:, None, None] * 1000 + np.arange(num_steps + 1)[:, None]
    obs = np.broadcast_to(obs, (num_envs, num_steps + 1, obs_size)).astype(np.float32)
    return sac.Transitions(
        obs=obs[:, :-1],
        actions=rng.uniform(-1, 1, (num_envs, num_steps, 2)).astype(np.float32),
        rewards=rng.normal(size=(num_envs, num_steps)).astype(np.float32),
        next_obs=obs[:, 1:],
        terminations=(rng.random((num_envs, num_steps)) < 0.1).astype(np.float32),
        valid=rng.random((num_envs, num_steps)) > 0.2,
    )


def test_replay_batches_depend_on_the_seed_the_index_and_the_data_only():
    rng = np.random.default_rng(0)
    args = sac.Args(buffer_size=100, batch_size=8)
    rollouts = [rollout_of(rng, [0, 1, 2, 3], 20) for _ in range(3)]
    # One actor thread of 4 environments, or two of 2: the learner inserts the same sequence.
    whole = sac.make_replay(args, 3, 2)
    split = sac.make_replay(args, 3, 2)
    for data in rollouts:
        sac.replay_insert(whole, data)
        halves = [
            sac.Transitions(*[field[rows] for field in data]) for rows in (slice(2), slice(2, 4))
        ]
        rollout = lambda half: sac.Rollout(
            update=1,
            policy_version=0,
            data=half,
            record=env_records.empty_record(2, "Hopper-v4"),
            timing={},
        )
        parts = [(r.data, r.record) for r in (rollout(halves[0]), rollout(halves[1]))]
        gathered, record = gathered_rollouts(parts, distributed=False)
        assert record.resets.shape == (4,)
        sac.replay_insert(split, gathered)
    # Reset steps are left out; FIFO keeps the newest 100 of the 3 rollouts' valid transitions.
    assert whole.size == 100 and whole.inserted == sum(d.valid.sum() for d in rollouts)
    for name, field, other_field in zip(sac.Batch._fields, whole.items, split.items):
        np.testing.assert_array_equal(field, other_field, err_msg=name)
    # The batch of optimizer step u is the same however the updates are grouped.
    together = sac.sample_batches(args, whole, first=5, count=6)
    apart = [
        sac.sample_batches(args, split, first=5, count=2),
        sac.sample_batches(args, split, 7, 4),
    ]
    for field, a, b in zip(
        sac.Batch._fields, together, sac.Batch(*map(np.concatenate, zip(*apart)))
    ):
        np.testing.assert_array_equal(a, b, err_msg=field)
    assert together.obs.shape == (6, 8, 3)
    # A transition's next observation is its observation's successor (the truncating step's is
    # the episode's last: the actor stores what envpool returned on that step).
    np.testing.assert_array_equal(together.next_obs, together.obs + 1)
    # Another seed, other batches.
    other = sac.sample_batches(sac.Args(buffer_size=100, batch_size=8, seed=2), whole, 5, 6)
    assert not np.array_equal(other.obs, together.obs)
    # Two learner devices take the two halves of every batch.
    shards = local_shares(together, 2, batch_axis=1)
    assert shards.obs.shape == (2, 6, 4, 3)
    np.testing.assert_array_equal(np.concatenate(list(shards.obs), axis=1), together.obs)


def test_gradient_updates_do_not_depend_on_their_grouping_into_calls():
    args = sac.Args(env_id="Hopper-v4", hiddens=(8,), batch_size=8, buffer_size=64)
    networks = sac.networks_of(args)
    replay = sac.make_replay(args, 11, 3)
    state = sac.init_state(args, sac.sizes_of(args, 1), networks, replay).learner
    devices = jax.local_devices()[:1]
    update_fn = sac.make_update(args, devices, networks)
    rng = np.random.default_rng(0)
    batches = sac.Batch(
        obs=rng.normal(size=(1, 2, 8, 11)).astype(np.float32),
        actions=rng.uniform(-1, 1, (1, 2, 8, 3)).astype(np.float32),
        rewards=rng.normal(size=(1, 2, 8)).astype(np.float32),
        next_obs=rng.normal(size=(1, 2, 8, 11)).astype(np.float32),
        terminations=np.zeros((1, 2, 8), np.float32),
    )
    first = jax.tree.map(lambda x: x[:, :1], batches)
    second = jax.tree.map(lambda x: x[:, 1:], batches)
    start = replicate(state, devices)
    after_one, _ = update_fn(start, first)
    # Optimizer step 1: the critics and their targets move; the actor and the temperature wait
    # for update 2 (--policy-frequency 2), which steps each of them twice.
    unchanged = lambda a, b: all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    assert unchanged(after_one.actor_params, start.actor_params)
    assert unchanged(after_one.log_alpha, start.log_alpha)
    assert not unchanged(after_one.critic_params, start.critic_params)
    assert not unchanged(after_one.target_critic_params, start.target_critic_params)
    one_by_one, _ = update_fn(after_one, second)
    together, metrics = update_fn(start, batches)
    assert int(together.step[0]) == 2
    assert int(together.critic_opt_state[0].count[0]) == 2
    assert int(together.actor_opt_state[0].count[0]) == 2
    assert int(together.alpha_opt_state[0].count[0]) == 2
    assert not unchanged(together.actor_params, start.actor_params)
    for a, b in zip(jax.tree.leaves(together), jax.tree.leaves(one_by_one)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The target critics took one Polyak step of tau = 0.005 per update.
    critic = jax.tree.leaves(after_one.critic_params)[0]
    target = jax.tree.leaves(after_one.target_critic_params)[0]
    initial = jax.tree.leaves(start.target_critic_params)[0]
    np.testing.assert_allclose(target, 0.005 * critic + 0.995 * initial, rtol=1e-5, atol=1e-7)
    assert set(metrics) >= {"qf_loss", "qf1_values", "actor_loss", "alpha", "alpha_loss"}
    # --no-autotune: the temperature stays at --alpha.
    fixed = dataclasses.replace(args, autotune=False, alpha=0.2)
    replay = sac.make_replay(fixed, 11, 3)
    state = sac.init_state(fixed, sac.sizes_of(fixed, 1), networks, replay).learner
    after, metrics = sac.make_update(fixed, devices, networks)(replicate(state, devices), batches)
    np.testing.assert_allclose(np.exp(after.log_alpha[0]), 0.2, rtol=1e-6)
    assert int(after.alpha_opt_state[0].count[0]) == 0 and float(metrics["alpha_loss"][0]) == 0.0
    assert int(after.actor_opt_state[0].count[0]) == 2


MODEL = "cleanba_sac.cleanba_model"
# Hopper: random actions end episodes (terminations) within a few dozen steps. 4 envs x 16 steps per
# update, 6 updates; learning starts at the second (128 steps), 32 optimizer steps each.
TINY = [
    "--env-id",
    "Hopper-v4",
    "--hiddens",
    16,
    16,
    "--batch-size",
    32,
    "--num-steps",
    16,
    "--local-num-envs",
    4,
    "--total-timesteps",
    384,
    "--learning-starts",
    128,
    "--replay-ratio",
    0.5,
    "--buffer-size",
    1000,
    "--log-frequency",
    1,
    "--save-model",
]

# Runs the script's main once per command, in one process (an import of JAX and envpool takes ~8 s
# of CPU here). A command may first copy another run's checkpoints up to an update, to resume from
# there; a command with "record" plays episodes of at most that many steps and saves what its
# environments returned and what the replay holds at the end; a "refused" command's exit code and
# stderr are saved to <name>.refused.json.
DRIVER = """
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import envpool
import jax
import numpy as np

import cleanba.cleanba_sac as script

sys.path.insert(0, sys.argv[2])
from preempt import run_command  # noqa: E402
from cleanba_utils.envs import flat_observation

make_env, make_replay = script.make_env, script.make_replay
recorded = dict(steps=[], replay=[])


class RecordingEnv:
    def __init__(self, env):
        self.env = env

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, *args):
        obs, info = self.env.reset(*args)
        recorded["steps"].append(dict(obs=flat_observation(obs)))
        return obs, info

    def xla(self):
        # The compiled rollout steps through envpool's XLA interface: every step is recorded by a
        # callback from inside the compiled program, in order.
        handle, recv, send, step = self.env.xla()

        def recording_step(handle, action, env_ids):
            handle, outputs = step(handle, action, env_ids)
            jax.debug.callback(record_step, action, *outputs[:4], ordered=True)
            return handle, outputs

        return handle, recv, send, recording_step


def record_step(action, obs, reward, terminated, truncated):
    recorded["steps"].append(
        dict(
            action=np.array(action),
            obs=flat_observation(obs),
            reward=np.array(reward),
            terminated=np.array(terminated),
            truncated=np.array(truncated),
        )
    )


def recording_make_env(args, seed, num_envs):
    if seed >= 1_000_000:
        return make_env(args, seed, num_envs)
    env = envpool.make(
        args.env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        max_episode_steps=MAX_EPISODE_STEPS,
    )
    return RecordingEnv(env)


def recording_make_replay(*args):
    recorded["replay"].append(make_replay(*args))
    return recorded["replay"][-1]


for command in json.loads(sys.argv[1]):
    run_dir = Path("runs") / command["name"]
    if command.get("refused"):
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            try:
                script.main(command["argv"])
            except SystemExit as exit_:
                refused = dict(code=exit_.code, stderr=captured.getvalue())
        Path(f"{command['name']}.refused.json").write_text(json.dumps(refused))
        continue
    if command.get("resume_from"):
        source, update = command["resume_from"]
        shutil.copytree(Path("runs") / source / "checkpoints", run_dir / "checkpoints")
        for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
            if int(checkpoint.stem.split("_")[1]) > update:
                checkpoint.unlink()
    MAX_EPISODE_STEPS = command.get("record")
    script.make_env = recording_make_env if MAX_EPISODE_STEPS else make_env
    script.make_replay = recording_make_replay
    recorded["steps"].clear()
    recorded["replay"].clear()
    run_command(script, command)
    if MAX_EPISODE_STEPS:
        steps = recorded["steps"]
        replay = recorded["replay"][-1]
        np.savez(
            run_dir / "recorded.npz",
            reset_obs=steps[0]["obs"],
            **{
                key: np.stack([step[key] for step in steps[1:]])
                for key in ["action", "obs", "reward", "terminated", "truncated"]
            },
            **{
                f"replay_{key}": value[: replay.size]
                for key, value in replay.items._asdict().items()
            },
        )
"""


def readme_commands() -> list[list[str]]:
    """The commands of docs/sac.md, each a list of arguments of the script."""
    readme = (REPO / "docs" / "sac.md").read_text()
    section = readme[readme.index("## Running it") :]
    block = section[section.index("```bash") + len("```bash") : section.index("```\n", 10)]
    lines = block.replace("\\\n", " ").splitlines()
    commands = [line.split() for line in lines if "cleanba_sac.py" in line]
    return [command[command.index("cleanba/cleanba_sac.py") + 1 :] for command in commands]


CONCURRENT = ["--checkpoint-every", 3]
SYNC = ["--no-concurrency", "--checkpoint-every", 3]
# Two processes: the same command in both (determinism across processes), the layouts, evaluation,
# the resumptions, and the recorded run (2 envs, episodes of at most 25 steps: truncations and
# terminations, 8 updates of 32 steps, the first 64 steps random). The second process starts with
# the runs that compile programs of their own (2 learner devices; actors of 2 environments), and
# finds the others in JAX's compilation cache.
PROCESSES = [
    [
        dict(
            name="indivisible", argv=["--batch-size", 255, "--learner-device-ids", 0, 1], refused=1
        ),
        dict(name="one", argv=CONCURRENT),
        # The README's first command at its defaults (256-256 networks, batches of 256), for one
        # update of 64 steps that learns.
        dict(name="readme", argv=["--total-timesteps", 64, "--learning-starts", 0], readme=True),
        dict(
            name="two_threads", argv=[*CONCURRENT, "--local-num-envs", 2, "--num-actor-threads", 2]
        ),
        dict(name="preempted", argv=[], preempted_after=2),
        dict(name="evaluated", argv=[*CONCURRENT, "--eval-episodes", 2, "--eval-every", 2]),
    ],
    [
        dict(name="two_learners", argv=[*CONCURRENT, "--learner-device-ids", 0, 1]),
        dict(
            name="recorded",
            argv=[
                *["--local-num-envs", 2, "--learning-starts", 64, "--total-timesteps", 256],
                *["--replay-ratio", 1],
            ],
            record=25,
        ),
        dict(name="sync", argv=SYNC),
        dict(name="sync_preempted", argv=["--no-concurrency"], preempted_after=3),
        dict(name="one_again", argv=CONCURRENT),
    ],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directory and stdout of each run; both processes see 2 CPU devices."""
    cwd = tmp_path_factory.mktemp("sac")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    processes = []
    for commands in PROCESSES:
        commands = [
            dict(c, argv=[*(readme_commands()[0] if c.get("readme") else TINY), *c["argv"]])
            for c in commands
        ]
        commands = [dict(c, argv=list(map(str, c["argv"]))) for c in commands]
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", DRIVER, json.dumps(commands), str(REPO / "tests")],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    stdout = ""
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        stdout += out
    return cwd / "runs", stdout


def test_a_batch_that_the_learner_devices_cannot_share_is_one_line_and_exit_2(runs):
    run_dirs, _ = runs
    refused = json.loads((run_dirs.parent / "indivisible.refused.json").read_text())
    lines = refused["stderr"].strip().splitlines()
    assert refused["code"] == 2 and len(lines) == 1, refused
    assert lines[0].startswith("error: --batch-size 255 must be divisible by the 2 learner")
    assert not (run_dirs / "indivisible").exists()


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_the_readme_commands_run(runs):
    commands = readme_commands()
    assert commands[0] == ["--env-id", "HalfCheetah-v4"] and len(commands) == 2
    assert sac.parse_args(commands[1]).eval_episodes == 10
    result = summary(runs[0] / "readme")
    assert result["global_step"] == 64
    assert scalars(runs[0] / "readme", "stats/optimizer_steps")[-1][1] == 64


def test_concurrent_run_has_lag_one_and_sync_run_lag_zero(runs):
    run_dirs, _ = runs
    assert_policy_lag(run_dirs / "one", concurrent=True, num_updates=6)
    assert_policy_lag(run_dirs / "sync", concurrent=False, num_updates=6)


def test_run_logs_learns_from_the_second_update_and_summarizes(runs):
    run_dir = runs[0] / "one"
    expected = {
        "charts/episodic_return",
        "charts/episodic_length",
        "charts/SPS",
        "losses/qf_loss",
        "losses/qf1_values",
        "losses/actor_loss",
        "losses/alpha",
        "losses/alpha_loss",
        "stats/optimizer_steps_per_second",
        "stats/rollout_queue_get_time",
        "stats/param_queue_get_time",
        "stats/replay_size",
        "stats/optimizer_steps",
    }
    assert expected <= scalar_tags(run_dir)
    assert [v for _, v in scalars(run_dir, "stats/optimizer_steps")] == [0, 32, 64, 96, 128, 160]
    assert summary(run_dir)["global_step"] == 384
    assert all(v > 0 for _, v in scalars(run_dir, "stats/optimizer_steps_per_second")[1:])


def test_same_command_twice_gives_the_same_fingerprint(runs):
    run_dirs, _ = runs
    fingerprint = summary(run_dirs / "one")["params_fingerprint"]
    assert summary(run_dirs / "one_again")["params_fingerprint"] == fingerprint
    # Evaluation plays environments of its own: the same run.
    assert summary(run_dirs / "evaluated")["params_fingerprint"] == fingerprint


def test_evaluation_is_logged_and_summarized(runs):
    run_dir = runs[0] / "evaluated"
    evaluations = scalars(run_dir, "charts/eval_return")
    assert [step for step, _ in evaluations] == [0, 128, 256, 384]
    assert scalars(run_dir, "charts/opt_step")[0] == (0, 0)
    result = summary(run_dir)
    assert result["eval_return"] == pytest.approx(evaluations[-1][1])
    assert [step for step, _ in result["eval_returns"]] == [0, 128, 256, 384]


# The same run under two layouts differs by float rounding only. Measured after 6 updates (160
# optimizer steps): 1 vs 2 learner devices, parameters at most 5.6e-7 apart (asserted with ~20x
# margin); 1 actor thread of 4 environments vs 2 of 2, identical. (An actor thread of one
# environment infers with a matrix-vector product, which rounds otherwise: 1.2e-6 apart.)
LAYOUT_ATOL = 1e-5


@pytest.mark.parametrize("layout", ["two_learners", "two_threads"])
def test_layout_changes_parameters_by_rounding_only(runs, layout):
    run_dirs, _ = runs
    reference = load_params(run_dirs / "one" / MODEL)
    assert max_abs_difference(reference, load_params(run_dirs / layout / MODEL)) < LAYOUT_ATOL


@pytest.mark.parametrize(
    "name,source,update", [("preempted", "one", 2), ("sync_preempted", "sync", 3)]
)
def test_a_preempted_and_resumed_run_repeats_the_uninterrupted_one(runs, name, source, update):
    # SIGTERM during update k: the checkpoint of update k holds the learner, the replay, the policy
    # the actors play the next rollout with, and what the environments did since their last reset:
    # the remaining updates see the same data and give the same parameters, bit for bit.
    assert_resumed_as_uninterrupted(*runs, name=name, source=source, update=update)


def test_the_replay_holds_every_step_but_the_reset_steps(runs):
    # Recomputed from what the environments returned: a transition per step (observation, action,
    # reward, next observation, termination) in global env order within each rollout, except
    # envpool's reset steps; a truncated episode's last transition has the episode's last
    # observation as its next and is not terminal.
    recorded = np.load(runs[0] / "recorded" / "recorded.npz")
    obs = np.concatenate([recorded["reset_obs"][None], recorded["obs"]])
    done = recorded["terminated"] | recorded["truncated"]
    is_reset = np.concatenate([np.zeros((1, 2), bool), done[:-1]])
    assert recorded["terminated"].any() and recorded["truncated"].any()
    expected = {key: [] for key in ["obs", "actions", "rewards", "next_obs", "terminations"]}
    for start in range(0, 256 // 2, 16):
        for env in range(2):
            for t in range(start, start + 16):
                if is_reset[t, env]:
                    continue
                expected["obs"].append(obs[t, env])
                expected["actions"].append(recorded["action"][t, env])
                expected["rewards"].append(recorded["reward"][t, env])
                expected["next_obs"].append(obs[t + 1, env])
                expected["terminations"].append(recorded["terminated"][t, env])
    assert len(expected["obs"]) == 256 - is_reset.sum()
    for key, values in expected.items():
        np.testing.assert_array_equal(recorded[f"replay_{key}"], np.array(values, np.float32))
    # The first 64 steps (32 of each env) are uniformly random in the action box [-1, 1].
    random_actions = recorded["action"][:32]
    assert np.abs(random_actions).max() <= 1.0 and 0.45 < random_actions.std() < 0.7


# Each refused with exit 2 and one line naming the option (or the scripts to use instead).
BAD_INPUTS = [
    (["--env-id", "NoSuchTask-v4"], "--env-id"),
    (["--env-id", "CartPole-v1"], "cleanba_ppo.py"),
    (["--env-id", "Breakout-v5"], "discrete"),
    (["--policy-lr", "nan"], "--policy-lr"),
    (["--q-lr", "inf"], "--q-lr"),
    (["--alpha-lr", "-1"], "--alpha-lr"),
    (["--tau", "0"], "--tau"),
    (["--gamma", "1.5"], "--gamma"),
    (["--batch-size", "0"], "--batch-size"),
    (["--policy-frequency", "0"], "--policy-frequency"),
    (["--replay-ratio", "0.3"], "--replay-ratio"),
    (["--buffer-size", "10"], "--buffer-size"),
    (["--buffer-size", str(10**11)], "--buffer-size"),
    (["--learning-starts", "2000000"], "--learning-starts"),
    (["--total-timesteps", "10", "--learning-starts", "0"], "--total-timesteps"),
    (["--hiddens", "0"], "--hiddens"),
    (["--learner-device-ids", "7"], "--learner-device-ids"),
    (["--resume"], "--resume"),
    (["--eval-episodes", "-1"], "--eval-episodes"),
]


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_refused_with_one_line(capsys, args, option):
    assert_refused(sac, args, option, capsys)


def test_a_crashing_actor_ends_the_process(tmp_path):
    args = [*TINY[:-1], "--total-timesteps", 1_000_000]
    result = run_failing("cleanba_sac", "actor", args, tmp_path)
    assert result.returncode == 1 and "environment exploded" in result.stderr, result.stderr[-3000:]
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


# The second update makes 2,048 optimizer steps of 1024-1024 networks (replay ratio 32): about 2
# minutes on 2 CPU cores (16 per second); the first only inserts (learning starts after it).
LONG_UPDATE = [
    *["--env-id", "Hopper-v4", "--hiddens", 1024, 1024, "--local-num-envs", 1, "--num-steps", 64],
    *["--learning-starts", 65, "--buffer-size", 1000, "--log-frequency", 1],
]


def saved_state(checkpoint) -> dict:
    data = checkpoint.read_bytes()
    return flatten(flax.serialization.msgpack_restore(data[64:])["state"])


def test_sigterm_in_the_middle_of_a_long_update_saves_the_update_before_within_seconds(tmp_path):
    # The update in flight is abandoned; the checkpoint of update 1 is the replay as it was after
    # update 1, although rollouts 2 and 3 (played meanwhile, --concurrency) were in it: the same
    # checkpoint, leaf for leaf, as a run whose update 2 is short saves after update 1.
    args = [*LONG_UPDATE, "--replay-ratio", 32, "--total-timesteps", 192, "--run-name", "long"]
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "cleanba" / "cleanba_sac.py"), *map(str, args)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_line(proc, "update 1/")
    sent_at = time.time()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143 and time.time() - sent_at < 30, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "stopped by a signal during update 2, which is abandoned; checkpoint of update 1 saved, "
        "continue with --resume"
    )
    reference = [
        *LONG_UPDATE,
        *["--replay-ratio", 0.5, "--total-timesteps", 128, "--checkpoint-every", 1],
        *["--run-name", "reference"],
    ]
    result = run_script("cleanba_sac.py", reference, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    name = "checkpoints/update_000000001.ckpt"
    saved = saved_state(tmp_path / "runs" / "long" / name)
    expected = saved_state(tmp_path / "runs" / "reference" / name)
    assert saved.keys() == expected.keys() and any("replay" in key for key in saved)
    for key, value in expected.items():
        np.testing.assert_array_equal(saved[key], value, err_msg=key)
