"""SLM Lab's eight metrics on hand-computed series and edge cases, the random baseline, and a real
small experiment whose `analyze --json` numbers are recomputed from its session CSVs with SLM Lab's
formulas written out here as plain loops."""

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import envpool
import numpy as np
import pytest
import tensorboardX

from cleanba_utils.experiments import analyze, slm_report
from cleanba_utils.experiments import random_baseline as rb
from cleanba_utils.experiments.slm_metrics import (
    SessionSeries,
    consistency,
    efficiency,
    session_metrics,
    stability,
    trial_metrics,
)

REPO = Path(__file__).resolve().parent.parent


def series(frames, returns, opt_steps=None):
    opt_steps = [math.nan] * len(frames) if opt_steps is None else opt_steps
    return SessionSeries(
        frame=np.array(frames),
        opt_step=np.array(opt_steps, float),
        total_reward=np.array(returns, float),
    )


def test_a_rising_curve():
    # Strengths 0, 10, 20, 30 over random 10; no drop.
    metrics = session_metrics(series([100, 200, 300, 400], [10, 20, 30, 40], [5, 10, 15, 20]), 10)
    assert metrics["final_return_ma"] == 25.0
    assert metrics["strength"] == 15.0
    assert metrics["max_strength"] == 30.0
    assert metrics["final_strength"] == 30.0
    # (0/100 + 10/200 + 20/300 + 30/400) / 60 and (0/5 + 10/10 + 20/15 + 30/20) / 60
    assert metrics["sample_efficiency"] == pytest.approx((0.05 + 1 / 15 + 0.075) / 60)
    assert metrics["training_efficiency"] == pytest.approx((1 + 4 / 3 + 1.5) / 60)
    assert metrics["stability"] == 1.0


def test_a_curve_with_drops():
    # Strengths 10, 30, 20, 40, 25: drops of 10 (30 to 20) and 15 (40 to 25) over the strengths
    # before each step, 10 + 30 + 20 + 40 = 100.
    metrics = session_metrics(series([1, 2, 3, 4, 5], [10, 30, 20, 40, 25]), 0)
    assert metrics["strength"] == 25.0
    assert metrics["max_strength"] == 40.0
    assert metrics["final_strength"] == 25.0
    assert metrics["stability"] == pytest.approx(1 - 25 / 100)
    assert math.isnan(metrics["training_efficiency"])  # opt_step not logged


def test_final_return_ma_averages_the_last_100_evaluations():
    returns = list(range(150))
    metrics = session_metrics(series(list(range(1, 151)), returns), 0)
    assert metrics["final_return_ma"] == pytest.approx(sum(range(50, 150)) / 100)


def test_a_first_checkpoint_at_t_0_is_left_out_of_the_numerator_only():
    # Strengths 5, 10, 20: 5 / 0 is left out above, 5 stays below.
    assert efficiency([5.0, 10.0, 20.0], [0, 100, 200]) == pytest.approx((0.1 + 0.1) / 35)
    # 0 / 0 too.
    assert efficiency([0.0, 10.0, 20.0], [0, 100, 200]) == pytest.approx((0.1 + 0.1) / 30)


def test_a_session_with_the_untrained_policys_evaluation_at_step_0():
    # Random 10, strengths 2, 20, 15 at frames 0, 100, 200 and optimizer steps 0, 10, 20: the point
    # at 0 counts in the strength, in the efficiencies' denominators and in the stability, and its
    # ratio 2 / 0 is left out of the efficiencies' numerators, as SLM Lab's code computes them.
    metrics = session_metrics(series([0, 100, 200], [12, 30, 25], [0, 10, 20]), 10)
    assert metrics["strength"] == pytest.approx(37 / 3)
    assert metrics["max_strength"] == 20.0
    assert metrics["final_strength"] == 15.0
    assert metrics["sample_efficiency"] == pytest.approx((20 / 100 + 15 / 200) / 37)
    assert metrics["training_efficiency"] == pytest.approx((20 / 10 + 15 / 20) / 37)
    # One drop, 20 to 15, over the strengths before each step, 2 + 20.
    assert metrics["stability"] == pytest.approx(1 - 5 / 22)


def test_a_zero_strength_sum_gives_nan():
    assert math.isnan(efficiency([-5.0, 5.0], [1, 2]))
    assert math.isnan(efficiency([0.0, 0.0], [1, 2]))
    assert math.isnan(stability([0.0, 0.0, 3.0]))  # no strength before the steps
    assert stability([-5.0, 5.0]) == 1.0  # no drop, strengths before: -5
    assert math.isnan(stability([4.0]))  # one checkpoint, no step
    assert math.isnan(consistency([[1.0, -1.0], [2.0, -2.0]]))  # means 1.5 and -1.5


def test_efficiency_with_an_unknown_time_is_nan():
    assert math.isnan(efficiency([1.0, 2.0], [1, math.nan]))


def test_two_sessions_that_differ():
    first = series([10, 20, 30], [10, 20, 30], [1, 2, 3])
    second = series([10, 20, 30], [20, 20, 50], [1, 2, 3])
    metrics = trial_metrics([first, second], 0)
    # Means 15, 20, 40; sample standard deviations |a - b| / sqrt(2): 10 / sqrt(2), 0, 20 / sqrt(2).
    assert metrics["consistency"] == pytest.approx(1 - 2 * (30 / math.sqrt(2)) / 75)
    assert metrics["strength"] == pytest.approx((20 + 30) / 2)
    # Second: drop 0, so both are 1.
    assert metrics["stability"] == 1.0
    first_efficiency = (1 + 1 + 1) / 60
    second_efficiency = (2 + 1 + 50 / 30) / 90
    expected = (first_efficiency + second_efficiency) / 2
    assert metrics["sample_efficiency"] == pytest.approx(expected)
    assert metrics["training_efficiency"] == pytest.approx(10 * expected)


def test_sessions_of_different_lengths_and_nan_session_metrics():
    # The third checkpoint only the first session reached: its mean (30) counts below, no std above.
    assert consistency([[10.0, 20.0, 30.0], [20.0, 20.0]]) == pytest.approx(
        1 - 2 * (10 / math.sqrt(2)) / (15 + 20 + 30)
    )
    # A session's NaN is left out of the trial's mean.
    with_opt = series([10, 20], [10, 30], [1, 2])
    without_opt = series([10, 20], [10, 30])
    metrics = trial_metrics([with_opt, without_opt], 0)
    assert metrics["training_efficiency"] == pytest.approx((10 + 15) / 40)


def test_one_session():
    one = series([10, 20, 30], [10, 20, 15], [1, 2, 3])
    metrics = trial_metrics([one], 0)
    assert math.isnan(metrics["consistency"])
    assert metrics["strength"] == 15.0
    assert metrics["stability"] == pytest.approx(1 - 5 / 30)


# === The random baseline ===


def fake_play(batches):
    """A `play` that returns the given batches in turn and records its calls."""
    calls = []

    def play(env_id, num_episodes, seed, action_seed):
        calls.append((num_episodes, seed, action_seed))
        return np.array(batches[len(calls) - 1], float)

    return play, calls


def test_measurement_stops_at_2_percent_standard_error(monkeypatch):
    monkeypatch.setattr(rb, "BATCH_EPISODES", 4)
    # n returns 9, 11, 9, 11, ...: sample variance n / (n - 1), standard error sqrt(1 / (n - 1)),
    # 2.085% of the mean 10 at n = 24 and 1.925% at n = 28: it stops after 7 batches.
    play, calls = fake_play([[9, 11, 9, 11]] * 10)
    baseline = rb.measure("Fake-v0", play)
    assert len(calls) == 7
    assert [call[1] for call in calls] == [0, 4, 8, 12, 16, 20, 24]
    assert [call[2] for call in calls] == list(range(7))
    assert baseline.mean == 10.0 and baseline.episodes == 28
    values = [9, 11] * 14
    std = math.sqrt(sum((v - 10) ** 2 for v in values) / 27)
    assert baseline.std == pytest.approx(std)
    assert baseline.standard_error == pytest.approx(std / math.sqrt(28))
    assert "under 2% of the mean" in baseline.source


def test_measurement_stops_at_the_cap(monkeypatch):
    monkeypatch.setattr(rb, "BATCH_EPISODES", 2)
    monkeypatch.setattr(rb, "MAX_EPISODES", 6)
    play, calls = fake_play([[0, 100]] * 5)
    baseline = rb.measure("Fake-v0", play)
    assert len(calls) == 3 and baseline.episodes == 6 and baseline.mean == 50.0
    assert "or more at the cap of 6" in baseline.source


def test_baseline_sources_and_cache(tmp_path):
    never = lambda *args: pytest.fail("played, but should not have")
    given = rb.random_baseline("CartPole-v1", {"random_scores": {"CartPole-v1": 7.0}}, None, never)
    assert given.mean == 7.0 and given.source == "spec random_scores"
    atari = rb.random_baseline("Breakout-v5", {}, tmp_path, never)
    assert atari.mean == 1.7 and atari.source == "published Atari random score"
    play, calls = fake_play([[20.0, 20.0] * 50])
    measured = rb.random_baseline("CartPole-v1", {}, tmp_path, play)
    assert measured.mean == 20.0 and len(calls) == 1
    cached = rb.random_baseline("CartPole-v1", {}, tmp_path, never)
    assert cached.mean == 20.0 and cached.episodes == 100
    assert f"read from {tmp_path / rb.CACHE_NAME}" in cached.source
    record = json.loads((tmp_path / rb.CACHE_NAME).read_text())
    assert list(record) == [rb.cache_key("CartPole-v1")] and "envpool" in next(iter(record))
    missing = rb.random_baseline("NoSuchGame-v0", {}, tmp_path)
    assert missing.mean == 0.0 and "envpool cannot play NoSuchGame-v0" in missing.source


# Machado et al. (2018) as cleanba_ppo.py plays Atari, and GALA's paper as cleanba_gala_a2c.py does,
# written out here: the reference does not read the scripts' settings.
MACHADO = dict(
    repeat_action_probability=0.25,
    full_action_space=True,
    episodic_life=False,
    noop_max=1,
    max_episode_steps=27_000,
    reward_clip=True,
)
GALA = dict(
    repeat_action_probability=0.0,
    full_action_space=False,
    episodic_life=True,
    noop_max=30,
    max_episode_steps=27_000,
    reward_clip=True,
)


def random_play_by_hand(env_id, num_episodes, num_actions, options, whole_games=False):
    """Environment i seeded with i, an action for each environment from numpy's generator seeded
    with 0 at every step, the unclipped rewards of each until its episode (or, with `whole_games`,
    its game) ends."""
    envs = envpool.make(env_id, env_type="gymnasium", num_envs=num_episodes, seed=0, **options)
    envs.reset()
    rng = np.random.default_rng(0)
    returns = [0.0] * num_episodes
    over = [False] * num_episodes
    while not all(over):
        actions = rng.integers(num_actions, size=num_episodes)
        _, reward, terminated, truncated, info = envs.step(actions)
        for i in range(num_episodes):
            if over[i]:
                continue
            returns[i] += float(info["reward"][i]) if "reward" in info else float(reward[i])
            ended = info["terminated"][i] if whole_games else terminated[i]
            over[i] = bool(ended or truncated[i])
    envs.close()
    return returns


def script(name):
    return rb.TrainingScript(REPO / "cleanba" / name, [])


@pytest.mark.parametrize(
    "name,env_id,num_actions,options,whole_games",
    [
        ("cleanba_ppo.py", "CartPole-v1", 2, {}, False),
        ("cleanba_ppo.py", "Breakout-v5", 18, MACHADO, False),
        ("cleanba_gala_a2c.py", "Breakout-v5", 4, GALA, True),
    ],
)
def test_random_play_in_a_scripts_environments(name, env_id, num_actions, options, whole_games):
    played = rb.play_under_script(script(name), env_id, 3)
    expected = random_play_by_hand(env_id, 3, num_actions, options, whole_games)
    assert played.tolist() == expected


def test_the_baseline_in_a_scripts_environments_is_cached_beside_the_published_score(tmp_path):
    calls = []

    def play(training_script, env_id, num_episodes):
        calls.append((training_script.path.name, env_id, num_episodes))
        return np.array([1.0, 2.0, 6.0])

    never = lambda *args: pytest.fail("played, but should not have")
    measured = rb.under_script("Breakout-v5", script("cleanba_ppo.py"), 3, tmp_path, play)
    assert calls == [("cleanba_ppo.py", "Breakout-v5", 3)]
    # Mean 3, sample variance (4 + 1 + 9) / 2 = 7.
    assert measured.mean == 3.0 and measured.episodes == 3
    assert measured.std == pytest.approx(math.sqrt(7))
    assert measured.standard_error == pytest.approx(math.sqrt(7 / 3))
    assert measured.published_score == 1.7
    assert "3 episodes in cleanba_ppo.py's environments" in measured.source
    line = rb.baseline_line("Breakout-v5", measured)
    assert line.endswith("; published Atari random score 1.7")
    cached = rb.under_script("Breakout-v5", script("cleanba_ppo.py"), 3, tmp_path, never)
    assert cached.mean == 3.0 and cached.published_score == 1.7 and "read from" in cached.source
    # Another count of episodes, another script's flags: measured again.
    rb.under_script("Breakout-v5", script("cleanba_ppo.py"), 4, tmp_path, play)
    flagged = rb.TrainingScript(REPO / "cleanba" / "cleanba_ppo.py", ["--hiddens", "32"])
    rb.under_script("Breakout-v5", flagged, 3, tmp_path, play)
    assert len(calls) == 3
    other_task = rb.under_script("CartPole-v1", script("cleanba_ppo.py"), 3, None, play)
    assert math.isnan(other_task.published_score)
    assert "published" not in rb.baseline_line("CartPole-v1", other_task)


def test_training_commands_name_their_script(tmp_path):
    (tmp_path / "cleanba").mkdir()
    (tmp_path / "cleanba" / "train.py").write_text("")
    by_path = rb.training_script("python -u cleanba/train.py --x 1 --y 'a b'", tmp_path)
    assert by_path == rb.TrainingScript(
        tmp_path / "cleanba" / "train.py", ["--x", "1", "--y", "a b"]
    )
    by_module = rb.training_script("python -m cleanba.train --x 1", tmp_path)
    assert by_module == rb.TrainingScript(tmp_path / "cleanba" / "train.py", ["--x", "1"])
    with pytest.raises(ValueError, match=r"missing\.py is not a file"):
        rb.training_script("python cleanba/missing.py", tmp_path)
    with pytest.raises(ValueError, match="names no script"):
        rb.training_script("python", tmp_path)


def test_cartpole_random_play():
    # Uniformly random CartPole-v1 lasts about 22 steps (22.0 +- 0.4 measured over 800 episodes).
    baseline = rb.measure("CartPole-v1")
    assert 20 < baseline.mean < 24
    assert baseline.standard_error < 0.02 * baseline.mean
    assert baseline.episodes >= 100 and baseline.episodes % 100 == 0


# === Reading the series from events ===


def write_eval_run(run_dir, points, opt_steps=True):
    writer = tensorboardX.SummaryWriter(str(run_dir))
    start = time.time()
    for i, (step, value) in enumerate(points):
        writer.add_scalar("charts/episodic_return", 1.0, step, walltime=start + i)
        writer.add_scalar("charts/eval_return", value, step, walltime=start + i)
        if opt_steps:
            writer.add_scalar("charts/opt_step", step / 4, step, walltime=start + i)
    writer.close()


def test_a_resumed_runs_series_keeps_the_evaluation_of_step_0(tmp_path):
    # Session 1 evaluates at steps 0 and 64 and is stopped after its checkpoint at 64; session 2
    # evaluates at 128 and, its run over, logs the final evaluation's episodes numbered 0 and 1,
    # which are no global steps.
    first = tensorboardX.SummaryWriter(str(tmp_path), filename_suffix=".first")
    for step, value in [(0, 9.0), (64, 20.0)]:
        first.add_scalar("charts/eval_return", value, step)
        first.add_scalar("charts/opt_step", step // 8, step)
    first.close()
    second = tensorboardX.SummaryWriter(str(tmp_path), filename_suffix=".second")
    second.add_scalar("charts/eval_return", 30.0, 128)
    second.add_scalar("charts/opt_step", 16, 128)
    for episode, value in enumerate([29.0, 31.0]):
        second.add_scalar("eval/episodic_return", value, episode)
    second.close()
    series = slm_report.read_series(tmp_path)
    assert series.frame.tolist() == [0, 64, 128]
    assert series.opt_step.tolist() == [0, 8, 16]
    assert series.total_reward.tolist() == [9.0, 20.0, 30.0]


def write_experiment_folder(runs_dir, trials, spec):
    runs_dir.mkdir(parents=True, exist_ok=True)
    experiment_dir = runs_dir / "_experiments" / "e"
    experiment_dir.mkdir(parents=True)
    record = {"experiment": "e", "method": "grid", "metric": "final_return", "spec": spec}
    record["trials"] = trials
    (experiment_dir / "experiment.json").write_text(json.dumps(record))
    return experiment_dir


def analyze_json(experiment_dir):
    result = subprocess.run(
        [sys.executable, "-m", "cleanba_utils.experiments.analyze", str(experiment_dir), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_series_from_events_with_and_without_opt_step(tmp_path):
    runs_dir = tmp_path / "runs"
    write_eval_run(runs_dir / "a", [(400, 10.0), (800, 30.0), (1200, 20.0)])
    write_eval_run(runs_dir / "b", [(400, 10.0), (800, 30.0), (1200, 20.0)], opt_steps=False)
    trials = [
        {
            "number": number,
            "params": {"--x": str(number)},
            "state": "complete",
            "value": None,
            "runs": [{"run_name": name, "env_id": "Fake-v0"}],
        }
        for number, name in enumerate("ab")
    ]
    experiment_dir = write_experiment_folder(runs_dir, trials, {"random_scores": {"Fake-v0": 0.0}})
    record, stderr = analyze_json(experiment_dir)
    assert "random baseline of Fake-v0: 0 (spec random_scores)" in stderr
    env = record["envs"]["Fake-v0"]
    with (experiment_dir / "sessions" / "a.csv").open() as file:
        rows = list(csv.reader(file))
    assert rows == [
        ["frame", "opt_step", "total_reward"],
        ["400", "100", "10.0"],
        ["800", "200", "30.0"],
        ["1200", "300", "20.0"],
    ]
    by_number = {trial["number"]: trial for trial in env["trials"]}
    # Strengths 10, 30, 20 (sum 60): (10/100 + 30/200 + 20/300) / 60.
    expected = (0.1 + 0.15 + 20 / 300) / 60
    assert by_number[0]["metrics"]["training_efficiency"] == pytest.approx(expected)
    assert by_number[0]["sessions"][0]["metrics"]["sample_efficiency"] == pytest.approx(
        expected / 4
    )
    assert by_number[1]["metrics"]["training_efficiency"] is None
    assert any("charts/opt_step" in note for note in by_number[1]["notes"])
    assert by_number[0]["metrics"]["consistency"] is None  # one session
    assert (experiment_dir / "sessions" / "b.csv").read_text().splitlines()[1] == "400,nan,10.0"
    for name in ("experiment_graph_Fake-v0.png", "trial_graph_Fake-v0_t0.png"):
        assert (experiment_dir / name).stat().st_size > 1000


def test_analyze_measures_the_random_baseline_in_the_scripts_environments(tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    # The untrained policy's evaluation at frame 0, then two more.
    write_eval_run(runs_dir / "a", [(0, 10.0), (400, 30.0), (800, 20.0)])
    trials = [
        {
            "number": 0,
            "params": {},
            "state": "complete",
            "value": None,
            "runs": [{"run_name": "a", "env_id": "CartPole-v1"}],
        }
    ]
    spec = {
        "command": f"python {REPO}/cleanba/cleanba_ppo.py --hiddens 16",
        "random_scores": {"CartPole-v1": 0.0},
    }
    experiment_dir = write_experiment_folder(runs_dir, trials, spec)
    argv = [str(experiment_dir), "--json", "--measure-random-baseline", "--random-episodes", "3"]
    analyze.main(argv)
    captured = capsys.readouterr()
    random_return = sum(random_play_by_hand("CartPole-v1", 3, 2, {})) / 3
    baseline = json.loads(captured.out)["envs"]["CartPole-v1"]["random_baseline"]
    assert baseline["mean"] == pytest.approx(random_return)
    assert baseline["episodes"] == 3 and baseline["published_score"] is None
    assert "random play, 3 episodes in cleanba_ppo.py's environments" in captured.err
    metrics = json.loads(captured.out)["envs"]["CartPole-v1"]["trials"][0]["metrics"]
    strengths = [10.0 - random_return, 30.0 - random_return, 20.0 - random_return]
    assert metrics["strength"] == pytest.approx(sum(strengths) / 3)
    # opt_step is frame / 4 here: 0, 100, 200.
    assert metrics["training_efficiency"] == pytest.approx(
        (strengths[1] / 100 + strengths[2] / 200) / sum(strengths)
    )
    # Read back from the experiment folder's cache the second time.
    analyze.main(argv)
    assert "read from" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command,extra,message",
    [
        ("python cleanba/missing.py", ["--measure-random-baseline"], "missing.py is not a file"),
        ("python cleanba/cleanba_ppo.py", ["--random-episodes", "3"], "needs --measure-random"),
    ],
)
def test_analyze_refuses_a_random_baseline_it_cannot_measure(
    tmp_path, capsys, command, extra, message
):
    runs_dir = tmp_path / "runs"
    write_eval_run(runs_dir / "a", [(0, 10.0), (400, 30.0)])
    trials = [
        {
            "number": 0,
            "params": {},
            "state": "complete",
            "value": None,
            "runs": [{"run_name": "a", "env_id": "CartPole-v1"}],
        }
    ]
    experiment_dir = write_experiment_folder(runs_dir, trials, {"command": command})
    with pytest.raises(SystemExit) as exit_:
        analyze.main([str(experiment_dir), *extra])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("analyze: error:") and message in lines[0]


# === A real experiment, recomputed by hand ===

# Learns quickly and unevenly: evaluations that rise and drop, so that every metric is exercised.
COMMAND = (
    f"{sys.executable} {REPO}/cleanba/cleanba_apex_dqn.py --hiddens 64 64 --local-num-envs 4 "
    "--num-steps 8 --total-timesteps 4096 --learning-starts 512 --batch-size 64 "
    "--updates-per-rollout 2 --buffer-size 8192 --target-update-period 50 --log-frequency 1000 "
    "--eval-episodes 4 --eval-every 16"
)
SPEC = f"""
command = "{COMMAND}"
env_ids = ["CartPole-v1"]
num_seeds = 2

[space]
"--learning-rate" = [1e-3, 1e-4]

[resources]
workers = 2
"""


def by_hand(rows, random_return):
    """SLM Lab's session metrics from a session CSV's rows, as plain loops."""
    frames = [float(row["frame"]) for row in rows]
    opt_steps = [float(row["opt_step"]) for row in rows]
    returns = [float(row["total_reward"]) for row in rows]
    strengths = [value - random_return for value in returns]
    total = 0.0
    for value in strengths:
        total += value

    def efficiency_by_hand(times):
        if any(math.isnan(t) for t in times):
            return None
        numerator = 0.0
        for value, t in zip(strengths, times):
            if t != 0:
                numerator += value / t
        return numerator / total

    drops = 0.0
    before = 0.0
    for i in range(len(strengths) - 1):
        drops += min(strengths[i + 1] - strengths[i], 0.0)
        before += strengths[i]
    last = returns[-100:]
    return {
        "final_return_ma": sum(last) / len(last),
        "strength": total / len(strengths),
        "max_strength": max(strengths),
        "final_strength": strengths[-1],
        "sample_efficiency": efficiency_by_hand(frames),
        "training_efficiency": efficiency_by_hand(opt_steps),
        "stability": 1 - abs(drops / before),
    }, strengths


def consistency_by_hand(strengths_per_session):
    """Sessions of equal length: 1 - sum_i 2 std_j / sum_i mean_j, std with n - 1."""
    spread = 0.0
    level = 0.0
    for column in zip(*strengths_per_session):
        mean = sum(column) / len(column)
        variance = sum((value - mean) ** 2 for value in column) / (len(column) - 1)
        spread += 2 * math.sqrt(variance)
        level += mean
    return 1 - spread / level


# In the long checks (`-m long`): its runs cost the README's test command about 25 s of a worker.
@pytest.mark.long
def test_real_experiment_metrics_match_a_computation_by_hand(tmp_path):
    (tmp_path / "spec.toml").write_text(SPEC)
    launched = subprocess.run(
        [sys.executable, "-m", "cleanba_utils.experiments.launch", "--spec", "spec.toml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert launched.returncode == 0, launched.stdout + launched.stderr[-2000:]
    experiment_dir = tmp_path / "runs" / "_experiments" / "spec"
    record, stderr = analyze_json(experiment_dir)
    env = record["envs"]["CartPole-v1"]
    random_return = env["random_baseline"]["mean"]
    assert 20 < random_return < 24 and "random play" in env["random_baseline"]["source"]
    assert f"random baseline of CartPole-v1: {random_return:.4g}" in stderr
    strengths_of = {}
    for trial in env["trials"]:
        assert len(trial["sessions"]) == 2
        per_session = []
        for session in trial["sessions"]:
            with (experiment_dir / session["series_csv"]).open() as file:
                rows = list(csv.DictReader(file))
            assert list(rows[0]) == ["frame", "opt_step", "total_reward"]
            # The untrained policy's evaluation at frame 0, then after updates 16, 32, 48 and 64.
            assert len(rows) == 5 and session["evaluations"] == 5
            assert (rows[0]["frame"], rows[0]["opt_step"]) == ("0", "0")
            expected, strengths = by_hand(rows, random_return)
            per_session.append((expected, strengths))
            for name, value in expected.items():
                got = session["metrics"][name]
                assert got == (None if value is None else pytest.approx(value)), name
        for name in per_session[0][0]:
            known = [expected[name] for expected, _ in per_session if expected[name] is not None]
            value = sum(known) / len(known) if known else None
            got = trial["metrics"][name]
            assert got == (None if value is None else pytest.approx(value)), name
        strengths_of[trial["number"]] = [strengths for _, strengths in per_session]
        assert trial["metrics"]["consistency"] == pytest.approx(
            consistency_by_hand(strengths_of[trial["number"]])
        )
    strengths = {trial["number"]: trial["metrics"]["strength"] for trial in env["trials"]}
    assert env["ranking_by_strength"] == sorted(strengths, key=lambda n: -strengths[n])
    report = (experiment_dir / "report.md").read_text()
    assert "## SLM Lab metrics on CartPole-v1" in report
    for name in ("experiment_graph_CartPole-v1.png", "trial_graph_CartPole-v1_t0.png"):
        assert (experiment_dir / name).stat().st_size > 1000
