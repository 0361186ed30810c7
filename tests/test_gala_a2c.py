"""cleanba_gala_a2c.py: the returns against a Python loop, the async mailbox on scripted message
orders, the placement of agents on devices, then short real runs in subprocesses (mostly 4
simulated CPU devices, one per agent; the same run with the 4 agents sharing 1 and 2 devices)."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from helpers import (
    PROMPT_EXIT_SECONDS,
    REPO,
    assert_refused,
    fingerprint_of,
    load_params,
    run_failing,
    run_script,
    scalars,
    seconds_after_failure,
)

from cleanba import cleanba_gala_a2c as gala

# 4 agents x 2 envs x 4 steps = 32 steps per update.
TINY = [
    "--env-id",
    "CartPole-v1",
    "--hiddens",
    16,
    "--local-num-envs",
    2,
    "--num-steps",
    4,
    "--log-frequency",
    5,
]
# Lock-step runs measure the gradient similarity (a second compilation) only on request.
SYNC_TINY = [*TINY, "--similarity-every", 1000]
STEPS_PER_UPDATE = 32


def python_nstep_returns(rewards, next_values, terminations, truncations, gamma):
    """The bootstrapped returns written out step by step, one environment."""
    returns, following = [0.0] * len(rewards), next_values[-1]
    for t in reversed(range(len(rewards))):
        if terminations[t]:
            following = rewards[t]
        elif truncations[t]:
            following = rewards[t] + gamma * next_values[t]
        else:
            following = rewards[t] + gamma * following
        returns[t] = following
    return np.array(returns)


def test_nstep_returns_match_python_loop():
    rng = np.random.default_rng(0)
    num_steps = 40
    rewards = rng.normal(size=num_steps).astype(np.float32)
    next_values = rng.normal(size=num_steps).astype(np.float32)
    terminations = rng.random(num_steps) < 0.1
    truncations = (rng.random(num_steps) < 0.1) & ~terminations
    returns = gala.nstep_returns(
        jnp.asarray(rewards),
        jnp.asarray(next_values),
        jnp.asarray(terminations, jnp.float32),
        jnp.asarray(truncations, jnp.float32),
        0.9,
    )
    expected = python_nstep_returns(rewards, next_values, terminations, truncations, 0.9)
    np.testing.assert_allclose(returns, expected, rtol=1e-5, atol=1e-5)


def message(sender, version):
    return gala.Message(sender, version, params=None)


def test_mailbox_overwrites_an_unread_message_and_keeps_one_per_peer():
    mailbox, stop = gala.Mailbox(), threading.Event()
    mailbox.post(message(3, 1))
    mailbox.post(message(2, 1))
    mailbox.post(message(3, 2))  # overwrites the unread (3, 1)
    assert [(m.sender, m.version) for m in mailbox.take([], stop)] == [(2, 1), (3, 2)]
    assert mailbox.overwritten == 1
    assert mailbox.take([], stop) == []  # read messages are gone
    mailbox.post(message(3, 3))  # the slot was read: nothing overwritten
    assert [(m.sender, m.version) for m in mailbox.take([], stop)] == [
        (3, 3)
    ] and mailbox.overwritten == 1


def test_staleness_bound_waits_only_after_tau_updates_without_a_message():
    """τ = 2, one in-peer (agent 1) that posts only when the test says so."""
    mailbox, stop, silent = gala.Mailbox(), threading.Event(), {1: 0}
    assert gala.receive(mailbox, silent, 2, stop) == [] and silent == {1: 1}  # update 1: no wait
    mailbox.post(message(1, 1))
    assert [m.version for m in gala.receive(mailbox, silent, 2, stop)] == [1] and silent == {1: 0}
    assert gala.receive(mailbox, silent, 2, stop) == []  # one silent update: still no wait
    # Second silent update: the agent blocks until agent 1 posts, 0.5 s from now.
    threading.Timer(0.5, mailbox.post, [message(1, 7)]).start()
    start = time.time()
    assert [m.version for m in gala.receive(mailbox, silent, 2, stop)] == [7] and silent == {1: 0}
    assert 0.4 < time.time() - start < 5
    # A finished peer is not waited for; without a bound, nothing is ever waited for.
    gala.receive(mailbox, silent, 2, stop)
    mailbox.close(1)
    assert gala.receive(mailbox, silent, 2, stop) == [] and silent == {1: 2}
    assert gala.receive(gala.Mailbox(), {1: 100}, 0, stop) == []


def test_a_blocked_agent_leaves_when_the_run_stops():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(gala.Stopped):
        gala.receive(gala.Mailbox(), {1: 5}, 2, stop)


def ring_matrix(num_agents, num_peers):
    """The sync gossip step X <- W X: agent i averages itself and its in-peers i-1 .. i-k."""
    w = np.eye(num_agents)
    for d in range(1, num_peers + 1):
        w += np.roll(np.eye(num_agents), -d, axis=1)
    return w / (1 + num_peers)


def initial_agent_params(args):
    """(agents, parameters): every agent's initial parameters, flattened."""
    state = gala.init_state(args, gala.sizes_of(args))[1].learner
    leaves = [
        np.asarray(x, np.float64).reshape(args.num_agents, -1)
        for x in gala.jax.tree.leaves(state.params)
    ]
    return np.concatenate(leaves, axis=1)


def logged(run_dir, tag):
    return np.array([value for _, value in sorted(scalars(run_dir, tag))])


def test_gossip_alone_converges_to_the_initial_average_at_the_second_eigenvalue_rate(tmp_path):
    updates, num_peers = 12, 1
    args = [*SYNC_TINY, "--learning-rate", 0, "--total-timesteps", updates * STEPS_PER_UPDATE]
    result = run_script(
        "cleanba_gala_a2c.py", [*args, "--run-name", "gossip", "--save-model"], tmp_path, devices=4
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "gossip"
    w = ring_matrix(4, num_peers)
    assert np.allclose(w.sum(0), 1) and np.allclose(
        w.sum(1), 1
    )  # doubly stochastic: the average is kept
    second = sorted(np.abs(np.linalg.eigvals(w)))[-2]
    distances = logged(run_dir, "stats/consensus_distance")
    assert len(distances) == updates
    # The ring is circulant, hence normal: the root-mean-square distance shrinks by |λ2| per update
    # exactly, once the components of the smaller eigenvalues are gone (|λ| = 0 for these rings:
    # after one update).
    np.testing.assert_allclose(distances[2:] / distances[1:-1], second, rtol=1e-3)
    x0 = initial_agent_params(gala.parse_args([str(a) for a in args]))
    expected = [
        np.sqrt(np.mean(np.sum((xt - xt.mean(0)) ** 2, 1)))
        for xt in [np.linalg.matrix_power(w, t) @ x0 for t in range(1, updates + 1)]
    ]
    np.testing.assert_allclose(distances, expected, rtol=1e-3)
    with open(run_dir / "cleanba_gala_a2c.cleanba_model", "rb") as f:
        saved = flax.serialization.msgpack_restore(f.read())["params"]
    saved = np.concatenate([np.asarray(x, np.float64).ravel() for x in gala.jax.tree.leaves(saved)])
    np.testing.assert_allclose(saved, x0.mean(0), atol=1e-6)


# The sync command of `learning_runs`: learning (the default learning rate) for 30 updates, with
# every agent's state in the checkpoint at the end.
LEARNING = [
    *SYNC_TINY,
    "--total-timesteps",
    30 * STEPS_PER_UPDATE,
    "--similarity-every",
    5,
    "--checkpoint-every",
    30,
    "--run-name",
    "learn",
]


def learning_run(tmp_path_factory, name: str, devices: int):
    cwd = tmp_path_factory.mktemp(name)
    result = run_script("cleanba_gala_a2c.py", LEARNING, cwd, devices=devices)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, cwd / "runs" / "learn", LEARNING


@pytest.fixture(scope="module")
def learning_runs(tmp_path_factory):
    """The sync command twice, one agent per device (4 devices)."""
    return [learning_run(tmp_path_factory, name, devices=4) for name in ["first", "second"]]


def test_sync_gossip_is_deterministic(learning_runs):
    (first, _, _), (second, _, _) = learning_runs
    assert fingerprint_of(first) == fingerprint_of(second)


def test_with_learning_the_distance_to_consensus_stays_in_the_bound_of_the_ring(learning_runs):
    """Each agent steps, then mixes its new parameters with its in-peer's: X_t = W (X_(t-1) + U_t),
    U_t the agents' local RMSProp steps, so the deviations from the average are E_t = W (E_(t-1) +
    U_t - Ū_t). W is circulant, hence normal, and shrinks what has zero mean over the agents by
    |λ2| at least: the RMS distance obeys d_t <= |λ2| (d_(t-1) + L), L >= max_i ‖u_i‖. RMSProp with
    epsilon added to the root moves parameter j by lr |g_j| / (sqrt(v_j) + eps), with v_j >= (1 -
    decay) g_j^2: at most lr / sqrt(1 - decay), and at most lr |g_j| / eps; the gradient's norm is
    clipped to c, so ‖u_i‖ <= lr min(c / eps, sqrt(P / (1 - decay))) for P parameters."""
    _, run_dir, args = learning_runs[0]
    x0 = initial_agent_params(gala.parse_args([str(a) for a in args]))
    second = sorted(np.abs(np.linalg.eigvals(ring_matrix(4, 1))))[-2]
    learning_rate = 7e-4 * np.sqrt(4)  # the paper's scaling by √(number of learners)
    step = learning_rate * min(0.5 / 0.01, np.sqrt(x0.shape[1] / (1 - 0.99)))
    bound = np.sqrt(np.mean(np.sum((x0 - x0.mean(0)) ** 2, 1)))
    distances = logged(run_dir, "stats/consensus_distance")
    assert len(distances) == 30
    for distance in distances:
        bound = second * (bound + step)
        assert distance <= bound * (1 + 1e-4), (distance, bound)
    assert (
        distances[-1] > 0
    )  # the agents learn different things: they do not collapse onto one point
    share = logged(
        run_dir, "stats/consensus_share"
    )  # the ε-ball relative to ‖x̄‖ contracts from the start
    assert share[-1] < share[0] / 10, share
    similarities = logged(run_dir, "stats/gradient_similarity")
    assert len(similarities) == 6 and np.all(np.abs(similarities) <= 1)
    assert logged(run_dir, "charts/agent_3/SPS").size == 30


# Every agent's parameters after the same run, the agents sharing devices or each on its own, differ
# by float rounding only (a block's gradients are computed batched): measured at most 1.5e-8 after
# 30 updates, on 1 and on 2 devices; asserted with cleanba_ppo.py's tolerance.
LAYOUT_ATOL = 1e-6


def checkpointed_agent_params(run_dir):
    """(agents, parameters) from the run's checkpoint, which holds every agent's state."""
    (checkpoint,) = (run_dir / "checkpoints").glob("*.ckpt")
    saved = flax.serialization.msgpack_restore(checkpoint.read_bytes()[64:])["state"]["params"]
    return np.concatenate(
        [np.asarray(x, np.float64).reshape(4, -1) for x in gala.jax.tree.leaves(saved)], axis=1
    )


@pytest.mark.parametrize("devices", [1, 2])
def test_agents_sharing_devices_learn_what_agents_on_devices_of_their_own_learn(
    tmp_path_factory, learning_runs, devices
):
    """The learning run with its 4 agents all on 1 device and 2 on each of 2 devices, against the
    same run with one agent per device: every agent's parameters, and what was logged of them."""
    _, reference_dir, _ = learning_runs[0]
    result, run_dir, _ = learning_run(tmp_path_factory, f"shared_{devices}", devices=devices)
    assert f"{devices} learner device(s)" in result.stdout
    reference = checkpointed_agent_params(reference_dir)
    shared = checkpointed_agent_params(run_dir)
    # The agents differ from each other far more than the layouts: an agent out of its place shows.
    assert np.max(np.abs(reference - reference.mean(0))) > 1000 * LAYOUT_ATOL
    assert np.max(np.abs(shared - reference)) < LAYOUT_ATOL
    for tag in ["stats/consensus_distance", "stats/gradient_similarity", "losses/value_loss"]:
        np.testing.assert_allclose(logged(run_dir, tag), logged(reference_dir, tag), rtol=1e-4)


def scripted_lockstep_update(monkeypatch, topology, params, grads):
    """One lock-step update of the agents whose parameters are the rows of `params`, with plain SGD
    at learning rate 1 and agent i's gradient scripted to `grads[i]`; every agent on this process's
    one device. Returns the new parameters, one row per agent."""
    num_agents = len(params)
    args = gala.parse_args(
        ["--env-id", "CartPole-v1", "--num-agents", str(num_agents), "--topology", topology]
    )
    no_losses = gala.Losses(policy_loss=0.0, value_loss=0.0, entropy=0.0)
    # The gradient is what the "rollout" carries.
    monkeypatch.setattr(
        gala,
        "a2c_gradients",
        lambda args, state, transitions, bootstrap_obs: (transitions, no_losses),
    )
    sgd = optax.sgd(1.0)
    states = [
        TrainState.create(apply_fn=None, params={"w": jnp.asarray(x)}, tx=sgd) for x in params
    ]
    state = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    update = gala.make_update(args, gala.agents_sharding(jax.devices()))
    state, _, _, _ = update(state, {"w": jnp.asarray(grads)}, jnp.zeros(num_agents), False)
    return np.asarray(state.params["w"])


def test_sync_gossip_moves_mean_by_mean_update(monkeypatch):
    """Algorithm 1: an agent takes its step, then averages its new parameters with the new ones of
    its in-peer, so the agents' mean moves by the mean of their steps (mixing with the in-peers'
    parameters from before the step moves it by half of that)."""
    params = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 6.0]])
    grads = np.array([[1.0, 0.0], [0.0, 2.0], [-4.0, 1.0]])  # the steps are -grads
    mixed = scripted_lockstep_update(monkeypatch, "gossip", params, grads)
    # By hand: x + u = (-1, 0), (3, -2), (4, 5); agent i averages with agent i - 1 on the ring.
    np.testing.assert_array_equal(mixed, [[1.5, 2.5], [1.0, -1.0], [3.5, 1.5]])
    np.testing.assert_array_equal(mixed.mean(0), params.mean(0) - grads.mean(0))
    # Equal steps: gossip and all-reduce A2C move the mean alike.
    equal = np.array([[0.5, -2.0]] * 3)
    gossip = scripted_lockstep_update(monkeypatch, "gossip", params, equal)
    allreduce = scripted_lockstep_update(monkeypatch, "allreduce", params, equal)
    np.testing.assert_array_equal(allreduce, params - equal)
    np.testing.assert_array_equal(gossip.mean(0), allreduce.mean(0))


def test_async_gossip_moves_mean_by_mean_update_when_every_message_arrives_in_time():
    """Staleness 0, scripted: every agent takes its step and broadcasts its new parameters (as the
    async agents do, with `broadcast`), then each one receives (with a bound of 1 it would wait for
    its in-peer) and mixes. The mean moves by the mean of the steps, as in sync mode."""
    params = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 6.0], [1.0, 1.0]])
    steps = np.array([[1.0, 0.0], [0.0, 2.0], [-4.0, 1.0], [2.0, 2.0]])
    num_agents = len(params)
    mailboxes = [gala.Mailbox() for _ in range(num_agents)]
    silent = [{(agent - 1) % num_agents: 0} for agent in range(num_agents)]
    stepped = params + steps
    for agent in range(num_agents):
        message = gala.Message(sender=agent, version=1, params=stepped[agent])
        gala.broadcast(mailboxes, [(agent + 1) % num_agents], message)
    mixed = []
    for agent in range(num_agents):
        messages = gala.receive(mailboxes[agent], silent[agent], 1, threading.Event())
        assert [(m.sender, m.version) for m in messages] == [((agent - 1) % num_agents, 1)]
        mixed.append(gala.mix(stepped[agent], [m.params for m in messages]))
    np.testing.assert_array_equal(mixed, (stepped + np.roll(stepped, 1, axis=0)) / 2)
    np.testing.assert_array_equal(np.mean(mixed, axis=0), params.mean(0) + steps.mean(0))


def test_an_atari_episode_ends_with_the_game_not_with_a_life():
    terminated = np.array([True, True, False, False])
    truncated = np.array([False, False, True, False])
    info = {"lives": np.array([2, 0, 3, 3]), "terminated": np.array([0, 1, 0, 0])}
    assert gala.episode_over(terminated, truncated, info).tolist() == [False, True, True, False]
    assert gala.episode_over(terminated, truncated, {}).tolist() == [True, True, True, False]


# 2 agents x 2 envs x 4 steps = 16 steps per update, 4 updates.
MINATAR_TINY = [
    *["--env-id", "gymnax:Breakout-MinAtar", "--channels", 4, "--hiddens", 16],
    *["--num-agents", 2, "--local-num-envs", 2, "--num-steps", 4, "--total-timesteps", 64],
    *["--similarity-every", 1000, "--log-frequency", 1000],
]


# In the long checks (`-m long`): its runs cost the README's test command about 20 s.
@pytest.mark.long
def test_minatar_in_the_compiled_rollout_repeats_its_fingerprint(tmp_path):
    """Each agent's actor plays its JAX environments in one compiled program on the agent's device
    (2 agents, one per device), the small float images through Young & Tian's MinAtar torso, the
    default --torso there (the paper's 8x8 stride-4 convolutions cannot take 10x10 images); the
    same seed gives the same run."""
    assert gala.parse_args(["--env-id", "gymnax:Breakout-MinAtar"]).torso == "minatar"
    fingerprints = []
    for name in "ab":
        args = [*MINATAR_TINY, "--save-model", "--run-name", name]
        result = run_script("cleanba_gala_a2c.py", args, tmp_path, devices=2)
        assert result.returncode == 0, result.stderr[-3000:]
        fingerprints.append(fingerprint_of(result))
    assert fingerprints[0] == fingerprints[1]
    params = load_params(tmp_path / "runs" / "a" / "cleanba_gala_a2c.cleanba_model")["params"]
    assert params["MinAtarTorso_0"]["Conv_0"]["kernel"].shape == (3, 3, 4, 4)


def test_allreduce_agents_hold_identical_parameters_after_every_update(tmp_path):
    args = [
        *SYNC_TINY,
        "--topology",
        "allreduce",
        "--total-timesteps",
        10 * STEPS_PER_UPDATE,
        "--run-name",
        "allreduce",
    ]
    result = run_script(
        "cleanba_gala_a2c.py",
        [*args, "--checkpoint-every", 10, "--eval-episodes", 3],
        tmp_path,
        devices=4,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "allreduce"
    assert logged(run_dir, "stats/consensus_spread").tolist() == [0.0] * 10
    # The evaluation of x̄: each episode, and their mean at the last step under its own key.
    episodes = logged(run_dir, "eval/episodic_return")
    assert len(episodes) == 3
    assert scalars(run_dir, "charts/eval_return") == [
        (10 * STEPS_PER_UPDATE, pytest.approx(np.mean(episodes)))
    ]
    # Independently of the logged statistics: the checkpoint holds every agent's state.
    flat = checkpointed_agent_params(run_dir)
    assert np.all(flat == flat[0])
    x0 = initial_agent_params(gala.parse_args([str(a) for a in args]))
    assert (
        np.all(x0 == x0[0]) and np.max(np.abs(flat[0] - x0[0])) > 1e-3
    )  # one shared policy, and it learned


def test_async_gossip_runs_and_measures_staleness(tmp_path):
    """The 4 agents share one device, as in the paper."""
    args = [
        *TINY,
        "--gossip",
        "async",
        "--staleness-bound",
        2,
        "--total-timesteps",
        20 * STEPS_PER_UPDATE,
    ]
    result = run_script("cleanba_gala_a2c.py", [*args, "--run-name", "async"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "async"
    fingerprint_of(result)
    total_mixed = 0
    for agent in range(4):
        staleness = logged(run_dir, f"stats/agent_{agent}/message_staleness")
        mixed = logged(run_dir, f"stats/agent_{agent}/messages_mixed")
        assert len(mixed) == 20 and set(mixed) <= {0, 1}
        # Receiver's update minus the sender's when it sent (negative when the sender is ahead).
        assert len(staleness) == np.count_nonzero(mixed) >= 1 and np.all(
            staleness == np.round(staleness)
        )
        total_mixed += len(staleness)
    # How many messages arrive in time depends on the threads' timing: an agent mixed 9 of its 20
    # updates on a loaded CPU, 10 or more alone.
    assert total_mixed >= 20
    assert len(logged(run_dir, "stats/consensus_distance_max")) >= 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_crashing_agent_ends_the_process_promptly(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    result = run_failing(
        "cleanba_gala_a2c",
        "actor",
        [
            *(SYNC_TINY if mode == "sync" else TINY),
            "--gossip",
            mode,
            "--total-timesteps",
            1_000_000,
        ],
        tmp_path,
    )
    assert result.returncode == 1 and "environment exploded" in result.stderr
    assert seconds_after_failure(result, time.time()) < PROMPT_EXIT_SECONDS


def test_agents_that_do_not_divide_over_the_processes_are_one_line(capsys, monkeypatch):
    monkeypatch.setattr(gala.jax, "process_count", lambda: 3)
    assert_refused(gala, ["--num-agents", "4"], "--num-agents", capsys)


@pytest.mark.parametrize(
    "num_agents, devices_per_process, num_processes, expected",
    [
        # (the device index of each agent of process 0, and every process's devices that hold some)
        (4, [1], 1, ([0, 0, 0, 0], [(0, 0)])),
        (4, [2], 1, ([0, 0, 1, 1], [(0, 0), (0, 1)])),
        (4, [3], 1, ([0, 0, 1, 1], [(0, 0), (0, 1)])),  # 3 devices: 2 of them, 2 agents each
        (4, [4], 1, ([0, 1, 2, 3], [(0, 0), (0, 1), (0, 2), (0, 3)])),
        (4, [8], 1, ([0, 1, 2, 3], [(0, 0), (0, 1), (0, 2), (0, 3)])),
        (6, [4], 1, ([0, 0, 1, 1, 2, 2], [(0, 0), (0, 1), (0, 2)])),
        (5, [4], 1, ([0, 0, 0, 0, 0], [(0, 0)])),
        # 3 agents per process; the process with fewer devices sets how many every process uses.
        (6, [3, 1], 2, ([0, 0, 0], [(0, 0), (1, 0)])),
        (6, [3, 4], 2, ([0, 1, 2], [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)])),
    ],
)
def test_agents_share_devices_in_equal_blocks(
    monkeypatch, num_agents, devices_per_process, num_processes, expected
):
    """Devices stand in as (process, index) pairs, as `jax.local_devices` lists them."""

    def local_devices(process_index=0):
        return [(process_index, i) for i in range(devices_per_process[process_index])]

    monkeypatch.setattr(gala.jax, "process_count", lambda: num_processes)
    monkeypatch.setattr(gala.jax, "process_index", lambda: 0)
    monkeypatch.setattr(gala.jax, "local_devices", local_devices)
    args = gala.parse_args(["--env-id", "CartPole-v1", "--num-agents", str(num_agents)])
    local, every = gala.agent_devices_of(args.num_agents)
    assert ([index for _, index in local], every) == expected


RING_SHIFT_PROGRAM = """
import jax
import numpy as np
from jax.sharding import PartitionSpec

from cleanba import cleanba_gala_a2c as gala

for num_devices, block in [(1, 5), (4, 1), (4, 2), (4, 3), (2, 3)]:
    num_agents = num_devices * block
    sharding = gala.agents_sharding(jax.devices()[:num_devices])
    rows = np.arange(num_agents * 2, dtype=np.float32).reshape(num_agents, 2)
    for distance in range(num_agents + 2):
        shifted = jax.jit(
            jax.shard_map(
                lambda x: gala.ring_shift(x, distance),
                mesh=sharding.mesh,
                in_specs=sharding.spec,
                out_specs=sharding.spec,
            )
        )(rows)
        assert np.array_equal(shifted, np.roll(rows, distance, axis=0)), (block, distance)
    mean = jax.jit(
        jax.shard_map(
            gala.agents_mean, mesh=sharding.mesh, in_specs=sharding.spec, out_specs=PartitionSpec()
        )
    )(rows)
    np.testing.assert_allclose(mean, rows.mean(0))
print("checked")
"""


def test_ring_shift_moves_agent_j_to_j_plus_distance_across_blocks_of_agents():
    """Agents in blocks of 1, 2, 3 and 5 on 1, 2 and 4 devices, against numpy's roll over the
    agents; and the mean over every agent."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RING_SHIFT_PROGRAM)],
        cwd=REPO,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "checked" in result.stdout, result.stderr[-3000:]


BAD_INPUTS = [
    (["--env-id", "Hopper-v4"], "cleanba/cleanba_ppo_continuous.py"),
    (["--num-agents", "0"], "--num-agents"),
    (["--num-agents", "1"], "--num-agents"),
    (["--num-peers", "4"], "--num-peers"),
    (["--num-peers", "0"], "--num-peers"),
    (["--topology", "star"], "--topology"),
    (["--gossip", "async", "--topology", "allreduce"], "--gossip"),
    (["--staleness-bound", "3"], "--staleness-bound"),
    (["--gossip", "async", "--checkpoint-every", "5"], "--gossip"),
    (["--learning-rate", "-1"], "--learning-rate"),
    (["--learning-rate", "nan"], "--learning-rate"),
    (["--gamma", "0"], "--gamma"),
    (["--local-num-envs", "0"], "--local-num-envs"),
    (["--similarity-every", "0"], "--similarity-every"),
    (["--channels", "16", "32"], "--channels"),
    (["--rmsprop-eps", "0"], "--rmsprop-eps"),
    (["--rmsprop-decay", "1.5"], "--rmsprop-decay"),
    (["--eval-actions", "argmax"], "--eval-actions"),
    (["--torso", "resnet"], "--torso"),
    (["--env-id", "gymnax:Breakout-MinAtar", "--torso", "nature"], "--torso"),
    (["--gossip", "async", "--similarity-every", "10"], "--similarity-every"),
    (["--num-steps", "0"], "--num-steps"),
    (["--env-id", "NoSuchGame-v5"], "--env-id"),
    (["--resume"], "--resume"),
]


@pytest.mark.parametrize("args,option", BAD_INPUTS)
def test_bad_input_is_refused_with_one_line(capsys, args, option):
    assert_refused(gala, args, option, capsys)
