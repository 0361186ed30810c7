"""Experiment reports: metrics on hand-made curves, whole reports of fake experiment folders, and
CLI errors."""

import json
import re
import time

import numpy as np
import optuna
import pytest
import tensorboardX
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from cleanba_utils.experiments.analyze import (
    agreement,
    auc,
    bootstrap_score,
    final_return,
    main,
    mean_band,
    normalize,
    on_grid,
    retention,
    sps,
    steps_to_threshold,
)
from cleanba_utils.experiments.events import read_scalars, running_mean

STEPS = np.array([10, 20, 30])
CURVE = np.array([0.0, 5.0, 15.0])  # running means of the last 2 of the returns 0, 10, 20


def test_curve_is_a_step_function_on_the_grid():
    np.testing.assert_allclose(running_mean([0.0, 10.0, 20.0], 2), CURVE)
    np.testing.assert_array_equal(
        on_grid(STEPS, CURVE, np.array([0, 9, 10, 15, 20, 29, 30, 31])),
        [np.nan, np.nan, 0, 0, 5, 5, 15, 15],
    )
    # Wall times out of order are sorted together with their values.
    np.testing.assert_array_equal(
        on_grid([3.0, 1.0, 2.0], [30.0, 10.0, 20.0], np.array([1.5, 2.5, 3.0])), [10, 20, 30]
    )


def test_auc_is_the_mean_of_the_curve_over_the_grid_points():
    assert auc(STEPS, CURVE, np.array([0, 10, 20, 25, 30, 35])) == pytest.approx(
        (0 + 5 + 5 + 15 + 15) / 5
    )
    # Grid point i is 30 i / 99: points 0-32 lie before the first episode, 33-65 see 0, 66-98 see 5,
    # 99 sees 15.
    assert auc(STEPS, CURVE, np.linspace(0, 30, 100)) == pytest.approx((33 * 0 + 33 * 5 + 15) / 67)


def test_final_return_normalize_and_sps():
    assert final_return(np.array([0.0, 10.0, 20.0]), 2) == 15.0
    assert final_return(np.array([4.0]), 100) == 4.0
    assert normalize(7.0, 2.0, 12.0) == pytest.approx(0.5)
    assert np.isnan(normalize(7.0, 2.0, 2.0))
    assert sps(np.array([100, 200]), np.array([1.0, 4.0])) == 50.0
    assert np.isnan(sps(np.array([100]), np.array([0.0])))


def test_steps_to_threshold():
    assert steps_to_threshold(STEPS, CURVE, 5.0) == 20
    assert steps_to_threshold(STEPS, CURVE, 15.0) == 30
    assert steps_to_threshold(STEPS, CURVE, -1.0) == 10
    assert np.isnan(steps_to_threshold(STEPS, CURVE, 15.5))


def test_retention():
    rising_then_falling = np.array([0.0, 10.0, 20.0, 12.0])
    assert retention(rising_then_falling, 0.0) == pytest.approx(12 / 20)
    assert retention(rising_then_falling, 4.0) == pytest.approx((12 - 4) / (20 - 4))
    assert retention(np.array([0.0, 10.0, 20.0]), 0.0) == 1.0
    assert retention(np.array([10.0, 20.0, 2.0]), 5.0) == 0.0  # ends below random: clipped
    assert np.isnan(retention(np.array([1.0, 2.0, 3.0]), 3.0))


def test_agreement():
    assert agreement(np.array([10.0, 20.0]), 0.0, 50.0) == pytest.approx(1 - 5 / 50)  # std 5
    assert agreement(np.array([10.0, 20.0]), 10.0, 35.0) == pytest.approx(1 - 5 / 25)
    assert agreement(np.array([0.0, 100.0]), 0.0, 40.0) == 0.0  # std 50 > 40: clipped
    assert agreement(np.array([7.0]), 0.0, 50.0) == 1.0


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:All-NaN slice")
def test_bootstrap_band_contains_the_mean_and_vanishes_for_identical_sessions():
    curves = np.random.default_rng(1).normal(size=(8, 50))
    mean, low, high = mean_band(curves, 500, 0)
    np.testing.assert_allclose(mean, curves.mean(axis=0))
    assert (low <= mean).all() and (mean <= high).all() and (low < high).all()
    same = np.tile(np.linspace(0, 1, 50), (4, 1))
    same[:, :5] = np.nan  # no session has reached these grid points yet
    mean, low, high = mean_band(same, 200, 0)
    np.testing.assert_allclose(low[5:], mean[5:])
    np.testing.assert_allclose(high[5:], mean[5:])
    assert np.isnan(mean[:5]).all()


def test_bootstrap_score():
    score, low, high = bootstrap_score([np.array([3.0, 3.0, 3.0])], [(0.0, 1.0)], 100, 0)
    assert score == low == high == 3.0
    # Two envs: 10 is halfway from 0 to 20, 3 halfway from 1 to 5.
    score, low, high = bootstrap_score(
        [np.array([10.0, 10.0]), np.array([3.0])], [(0.0, 20.0), (1.0, 5.0)], 100, 0
    )
    assert score == pytest.approx(0.5) and low == pytest.approx(0.5) and high == pytest.approx(0.5)
    score, low, high = bootstrap_score([np.array([0.0, 10.0])], [(0.0, 1.0)], 1000, 0)
    assert score == 5.0 and low == 0.0 and high == 10.0


def test_a_resumed_run_is_read_without_its_downtime_and_repeated_steps(tmp_path):
    # Session 1 logs returns at steps 100..800, one every 10 s, and is stopped; its checkpoint was
    # at step 500. Session 2 resumes from it: the SPS at step 600 after 4 s, then returns at steps
    # 600..900, one every 5 s. Its events carry the times of its own clock, which starts when it
    # opens its file: the time between the two sessions (here the fake 80 s of session 1 overlap it)
    # is no part of the run's wall time.
    first = tensorboardX.SummaryWriter(str(tmp_path), filename_suffix=".first")
    opened = time.time()
    for i in range(1, 9):
        first.add_scalar("charts/episodic_return", float(i), 100 * i, walltime=opened + 10 * i)
    first.close()
    second = tensorboardX.SummaryWriter(str(tmp_path), filename_suffix=".second")
    opened = time.time()
    second.add_scalar("charts/SPS", 50.0, 600, walltime=opened + 4)
    for i in range(6, 10):
        second.add_scalar(
            "charts/episodic_return", 100.0 + i, 100 * i, walltime=opened + 5 * (i - 5)
        )
    second.close()
    scalars = read_scalars(tmp_path)
    np.testing.assert_array_equal(scalars.steps, [100, 200, 300, 400, 500, 600, 700, 800, 900])
    np.testing.assert_array_equal(scalars.values, [1, 2, 3, 4, 5, 106, 107, 108, 109])
    np.testing.assert_allclose(scalars.wall_times, [10, 20, 30, 40, 50, 85, 90, 95, 100], atol=0.5)


def write_run(runs_dir, run_name, returns):
    """TensorBoard events as a training script writes them: one episode every 100 steps and 2
    seconds."""
    writer = tensorboardX.SummaryWriter(str(runs_dir / run_name))
    start = time.time()
    for i, value in enumerate(returns):
        writer.add_scalar(
            "charts/episodic_return", value, 100 * (i + 1), walltime=start + 2 * (i + 1)
        )
    writer.close()


def write_experiment(tmp_path, name, method, metric, trials, spec=None):
    """An experiment folder and its runs; `trials` is [(params, state, value, {env_id: [returns per
    seed]})]."""
    runs_dir = tmp_path / "runs"
    records = []
    for number, (params, state, value, by_env) in enumerate(trials):
        runs = []
        for env_id, seeds in by_env.items():
            for seed, returns in enumerate(seeds, start=1):
                run_name = f"{env_id}__{name}__{number}__{seed}"
                if returns:
                    write_run(runs_dir, run_name, returns)
                runs.append({"run_name": run_name, "env_id": env_id, "seed": seed, "exit_code": 0})
        records.append(
            {"number": number, "params": params, "state": state, "value": value, "runs": runs}
        )
    experiment_dir = runs_dir / "_experiments" / name
    experiment_dir.mkdir(parents=True)
    record = {
        "experiment": name,
        "git_sha": "abc123",
        "method": method,
        "metric": metric,
        "spec": spec or {},
    }
    (experiment_dir / "experiment.json").write_text(json.dumps({**record, "trials": records}))
    return experiment_dir


def create_study(experiment_dir, name):
    return optuna.create_study(
        study_name=name,
        storage=JournalStorage(JournalFileBackend(str(experiment_dir / "study.journal"))),
    )


def ranking(report):
    """Trial numbers of the ranking table, best first."""
    section = report.split("## Ranking")[1].split("\n## ")[0]
    return [int(number) for number in re.findall(r"^\| \d+ \| #(\d+) \|", section, re.MULTILINE)]


def pngs_are_written(out_dir, names):
    return all((out_dir / name).is_file() and (out_dir / name).stat().st_size > 0 for name in names)


def test_grid_experiment_report(tmp_path, capsys):
    ramp = lambda top: list(np.linspace(10, top, 30))
    experiment_dir = write_experiment(
        tmp_path=tmp_path,
        name="grid1",
        method="grid",
        metric="final_return",
        trials=[
            (
                {"--learning-rate": "0.001"},
                "complete",
                100.0,
                {"CartPole-v1": [ramp(100), ramp(110)]},
            ),
            (
                {"--learning-rate": "0.01"},
                "complete",
                200.0,
                {"CartPole-v1": [ramp(200), ramp(210)]},
            ),
            (
                {"--learning-rate": "0.1"},
                "pruned",
                None,
                {"CartPole-v1": [ramp(50)[:12], ramp(60)[:10]]},
            ),
            ({"--learning-rate": "1.0"}, "failed", None, {"CartPole-v1": [[], []]}),
        ],
        spec={"thresholds": {"CartPole-v1": 150.0}},
    )
    main([str(experiment_dir), "--last-n", "5", "--reps", "200"])
    report_path = experiment_dir / "report.md"
    assert capsys.readouterr().out.strip() == str(report_path)
    report = report_path.read_text()
    assert report.startswith("# Experiment grid1")
    assert "abc123" in report and "method grid" in report
    assert ranking(report) == [1, 0, 2]
    # Trial 1: the last 5 of 30 evenly spaced returns average 2 steps below the top: 200 - 2 * 190 /
    # 29 = 186.897 and 210 - 2 * 200 / 29 = 196.207, mean 191.55.
    assert "| #1 | learning-rate=0.01 | 191.6 [" in report
    assert (
        "pruned, ran to step 1,200" in report
    )  # its longer session logged 12 episodes, 100 steps apart
    assert "| – | #3 | learning-rate=1.0 | – | failed, not ranked |" in report
    assert "threshold = 150 (spec thresholds)" in report
    # CartPole's random baseline is measured by random play (test_slm_metrics.py checks its value).
    assert "random = " in report and "random play, " in report
    assert "(2/2 reached)" in report and "(0/2 reached)" in report
    assert "CartPole-v1__grid1__3__1 (trial 3) has logged no episode; skipped" in report
    names = ["curves_CartPole-v1_steps.png", "curves_CartPole-v1_wall_time.png", "history.png"]
    assert pngs_are_written(experiment_dir, names)
    assert all(f"]({name})" in report for name in names)


def test_tpe_experiment_on_atari_games(tmp_path, capsys):
    name = "tpe1"
    games = {"Breakout-v5": (1.7, 30.0), "Pong-v5": (-20.7, 10.0)}
    values = {0: 0.2, 1: 0.9, 2: 0.5, 3: None}
    trials = []
    for number, top in values.items():
        by_env = {
            env: [list(np.linspace(low, low + (high - low) * (top or 0.1), 20))] * 2
            for env, (low, high) in games.items()
        }
        state = "pruned" if top is None else "complete"
        trials.append(({"--learning-rate": str(10.0**-number)}, state, top, by_env))
    trials.append(({"--learning-rate": "10.0"}, "failed", None, {}))
    experiment_dir = write_experiment(
        tmp_path=tmp_path, name=name, method="tpe", metric="auc", trials=trials
    )
    study = create_study(experiment_dir, name)
    distribution = optuna.distributions.FloatDistribution(1e-5, 1.0, log=True)
    for number, value in values.items():
        params = {"--learning-rate": 10.0**-number}
        state = (
            optuna.trial.TrialState.PRUNED if value is None else optuna.trial.TrialState.COMPLETE
        )
        intermediate = {1000: 0.1} if value is None else None
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions={"--learning-rate": distribution},
                value=value,
                state=state,
                intermediate_values=intermediate,
            )
        )
    out_dir = tmp_path / "out"
    main([str(experiment_dir), "--out-dir", str(out_dir), "--reps", "100"])
    report = (out_dir / "report.md").read_text()
    assert ranking(report) == [1, 2, 0, 3]
    assert "| – | #4 | learning-rate=10.0 | – | failed, not ranked |" in report
    # Every curve rises linearly from random by a fraction `top` of the way to `high`, so its auc
    # above random is proportional to top: trial 2 scores 0.5 / 0.9 of the best on both games.
    assert "| 2 | #2 | learning-rate=0.01 | 0.5556 [0.5556, 0.5556] | complete |" in report
    assert "auc (normalized, mean over envs)" in report
    assert "published Atari random score" in report
    assert "## Human-normalized scores" in report and "Optimality gap" in report
    # Trial 1's final returns are the means of its ramps: Breakout (1.7 + 27.17) / 2 = 14.435, HNS
    # (14.435 - 1.7) / (30.5 - 1.7) = 0.4422; Pong (-20.7 + 6.93) / 2 = -6.885, HNS (-6.885 + 20.7)
    # / 35.3 = 0.3914.
    hns_row = (
        "| #1 | 0.417 [0.417, 0.417] | 0.417 [0.417, 0.417] | 0.417 [0.417, 0.417] "
        "| 0.583 [0.583, 0.583] |"
    )
    assert hns_row in report
    assert (
        "| parameter | importance (PED-ANOVA) |" in report
        and "| --learning-rate | 1.000 |" in report
    )
    names = [f"curves_{game}_{axis}.png" for game in games for axis in ("steps", "wall_time")]
    assert pngs_are_written(out_dir, [*names, "history.png"])
    assert not (experiment_dir / "report.md").exists()


@pytest.mark.parametrize(
    "study_name, message",
    [
        ("tpe2", "not enough complete trials"),
        ("another", "Parameter importances could not be computed: KeyError"),
        (None, "No study.journal, so no parameter importances."),
    ],
)
def test_importances_that_cannot_be_computed_leave_a_line(tmp_path, capsys, study_name, message):
    trial = ({}, "complete", 1.0, {"CartPole-v1": [[1.0, 2.0]]})
    experiment_dir = write_experiment(
        tmp_path=tmp_path, name="tpe2", method="tpe", metric="final_return", trials=[trial]
    )
    if study_name:
        study = create_study(experiment_dir, study_name)
        study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1.0))
    main([str(experiment_dir)])
    assert message in (experiment_dir / "report.md").read_text()


@pytest.mark.parametrize(
    "problem, message",
    [
        ("missing", "is not a folder"),
        ("no_json", "experiment.json does not exist"),
        ("broken_json", "is not an experiment record"),
        ("no_trials_key", "is not an experiment record"),
        ("no_episodes", "has logged an episode yet"),
        ("bad_metric", "has metric 'loss'"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, problem, message):
    experiment_dir = tmp_path / "runs" / "_experiments" / "e"
    if problem != "missing":
        experiment_dir.mkdir(parents=True)
    trial = {
        "number": 0,
        "params": {},
        "state": "complete",
        "value": None,
        "runs": [{"run_name": "r", "env_id": "E"}],
    }
    record = {
        "experiment": "e",
        "method": "grid",
        "metric": "final_return",
        "spec": {},
        "trials": [trial],
    }
    text = {
        "broken_json": "{not json",
        "no_trials_key": json.dumps({"experiment": "e"}),
        "no_episodes": json.dumps(record),
        "bad_metric": json.dumps({**record, "metric": "loss"}),
    }
    if problem in text:
        (experiment_dir / "experiment.json").write_text(text[problem])
    with pytest.raises(SystemExit) as exit_info:
        main([str(experiment_dir)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("analyze: error: ") and message in err


def test_bad_option_exits_2_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--reps", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reps" in err
