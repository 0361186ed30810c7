"""Human-normalized scores: hand-computed metrics, run-folder collection, plots and CLI errors."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorboardX
from rliable import metrics

from cleanba_utils.experiments.hns import aggregate, human_normalized, main, reference_scores

REPO = Path(__file__).resolve().parents[1]
METRIC_NAMES = {"median", "iqm", "mean", "optimality_gap"}
SCORES_HEADER = "algorithm,env_id,seed,score\n"


def write_run(runs_dir, exp_name, env_id, seed, returns, eval_returns=()):
    """A run folder as the training scripts write it: spec.json plus TensorBoard events, one
    training episode every 100 steps and 10 seconds."""
    run_name = f"{env_id}__{exp_name}__{seed}"
    run_dir = runs_dir / run_name
    run_dir.mkdir(parents=True)
    spec = {"args": {"exp_name": exp_name, "env_id": env_id, "seed": seed}, "run_name": run_name}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    writer = tensorboardX.SummaryWriter(str(run_dir))
    start = time.time()
    for i, value in enumerate(returns):
        writer.add_scalar("charts/episodic_return", value, 100 * (i + 1), walltime=start + 10 * i)
    for value in eval_returns:
        writer.add_scalar("eval/episodic_return", value, 100 * len(returns))
    writer.close()


def read_rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def point_estimates(per_game):
    return {
        name: value
        for name, (value, _) in aggregate({"algo": per_game}, reps=10, seed=0)["algo"].items()
    }


def test_hns_is_zero_for_random_and_one_for_human():
    # Breakout: random 1.7, human 30.5; Pong: random -20.7, human 14.6.
    assert human_normalized("Breakout-v5", 1.7) == pytest.approx(0.0)
    assert human_normalized("Breakout-v5", 30.5) == pytest.approx(1.0)
    assert human_normalized("Breakout-v5", 16.1) == pytest.approx(0.5)  # (16.1 - 1.7) / 28.8
    assert human_normalized("Pong-v5", -3.05) == pytest.approx(0.5)  # (-3.05 + 20.7) / 35.3
    np.testing.assert_allclose(human_normalized("Breakout-v5", np.array([1.7, 59.3])), [0.0, 2.0])
    assert len(reference_scores()) == 57


def test_unknown_game_is_refused():
    with pytest.raises(ValueError, match="'CartPole-v1' is not one of the 57 Atari games"):
        human_normalized("CartPole-v1", 100.0)


def test_metrics_with_equal_seeds_match_hand_computation_and_rliable():
    per_game = {"A": np.array([0.0, 1.0]), "B": np.array([0.5, 2.5]), "C": np.array([0.2, 0.4])}
    # Game means 0.5, 1.5, 0.3. IQM trims int(6 / 4) = 1 score from each end of
    # 0, 0.2, 0.4, 0.5, 1, 2.5. Scores clipped at 1 sum to 3.1 over 6 runs.
    expected = {
        "median": 0.5,
        "iqm": (0.2 + 0.4 + 0.5 + 1.0) / 4,
        "mean": 2.3 / 3,
        "optimality_gap": 1 - 3.1 / 6,
    }
    assert point_estimates(per_game) == pytest.approx(expected)
    matrix = np.stack(list(per_game.values()), axis=1)
    assert expected["iqm"] == pytest.approx(metrics.aggregate_iqm(matrix))
    assert expected["optimality_gap"] == pytest.approx(metrics.aggregate_optimality_gap(matrix))


def test_metrics_with_unequal_seeds_weigh_every_game_equally():
    per_game = {"A": np.array([0.0, 1.0]), "B": np.array([2.0]), "C": np.array([0.2, 0.4, 0.6])}
    # Game means 0.5, 2, 0.4 (pooling the six runs would give B's single seed a sixth of the mean's
    # weight: 4.2 / 6 = 0.7); clipped at 1: 0.5, 1, 0.4. For the IQM each game fills 6 runs (lcm of
    # 2, 1, 3): A 0,0,0,1,1,1  B 2 x 6  C 0.2,0.2,0.4,0.4,0.6,0.6; int(18 / 4) = 4 scores are
    # trimmed from each end of the sorted 18, leaving 0.2,0.4,0.4,0.6,0.6,1,1,1,2,2.
    expected = {"median": 0.5, "iqm": 9.2 / 10, "mean": 2.9 / 3, "optimality_gap": 1 - 1.9 / 3}
    assert point_estimates(per_game) == pytest.approx(expected)


def test_bootstrap_resamples_seeds_within_each_game():
    # Game A's single seed is in every resample, so the mean of game means is (5 + 0), (5 + 0.5) or
    # (5 + 1), halved: its interval lies within [2.5, 3].
    per_game = {"A": np.array([5.0]), "B": np.array([0.0, 1.0])}
    value, (lower, upper) = aggregate({"algo": per_game}, reps=200, seed=0)["algo"]["mean"]
    assert value == pytest.approx(2.75)
    assert 2.5 <= lower <= upper <= 3.0


def test_bootstrap_interval_contains_point_and_narrows_with_more_seeds():
    rng = np.random.default_rng(0)
    game_means = np.linspace(0.2, 1.2, 6)

    def intervals(seeds):
        per_game = {
            f"game{i}": rng.normal(mean, 0.5, size=seeds) for i, mean in enumerate(game_means)
        }
        return aggregate({"algo": per_game}, reps=500, seed=0)["algo"]

    few = intervals(3)
    many = intervals(30)
    assert set(few) == METRIC_NAMES
    for name in METRIC_NAMES:
        for value, (lower, upper) in (few[name], many[name]):
            assert lower <= value <= upper
        assert many[name][1][1] - many[name][1][0] < few[name][1][1] - few[name][1][0]


def test_collect_reads_spec_and_tensorboard_events(tmp_path, capsys):
    runs = tmp_path / "runs"
    write_run(
        runs_dir=runs,
        exp_name="cleanba_ppo",
        env_id="Breakout-v5",
        seed=1,
        returns=[1, 2, 3, 4, 5],
        eval_returns=[10, 20],
    )
    write_run(runs_dir=runs, exp_name="cleanba_ppo", env_id="Breakout-v5", seed=2, returns=[2, 4])
    write_run(
        runs_dir=runs, exp_name="cleanba_impala", env_id="Pong-v5", seed=1, returns=[-21, -20, -19]
    )
    (runs / "_launcher").mkdir()  # not a run folder: no spec.json
    scores = tmp_path / "scores.csv"
    curves = tmp_path / "curves.csv"
    args = [
        "--runs-dir",
        str(runs),
        "--scores-out",
        str(scores),
        "--curves-out",
        str(curves),
        "--last-n",
        "2",
    ]
    main(["collect", *args, "--label", "cleanba_ppo=PPO"])
    assert read_rows(scores) == [
        {"algorithm": "PPO", "env_id": "Breakout-v5", "seed": "1", "score": "4.5"},
        {"algorithm": "PPO", "env_id": "Breakout-v5", "seed": "2", "score": "3.0"},
        {"algorithm": "cleanba_impala", "env_id": "Pong-v5", "seed": "1", "score": "-19.5"},
    ]
    first_run = [
        row for row in read_rows(curves) if row["algorithm"] == "PPO" and row["seed"] == "1"
    ]
    assert [int(row["global_step"]) for row in first_run] == [100, 200, 300, 400, 500]
    assert [float(row["score"]) for row in first_run] == [1.0, 1.5, 2.5, 3.5, 4.5]
    np.testing.assert_allclose(
        [float(row["wall_time_s"]) for row in first_run], [0, 10, 20, 30, 40], atol=1.0
    )
    assert len(read_rows(curves)) == 10

    main(["collect", *args, "--metric", "eval"])
    assert read_rows(scores) == [
        {"algorithm": "cleanba_ppo", "env_id": "Breakout-v5", "seed": "1", "score": "15.0"}
    ]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all("logged no eval/episodic_return" in line for line in warnings)


def test_aggregate_prints_table_and_json(tmp_path, capsys):
    # HNS: Breakout 1 and 0 (mean 0.5), Pong 1 and 1 (mean 1); median and mean of the game means
    # 0.75.
    scores = tmp_path / "scores.csv"
    rows = [
        "PPO,Breakout-v5,1,30.5",
        "PPO,Breakout-v5,2,1.7",
        "PPO,Pong-v5,1,14.6",
        "PPO,Pong-v5,2,14.6",
    ]
    scores.write_text(SCORES_HEADER + "\n".join(rows))
    main(["aggregate", "--scores", str(scores), "--reps", "50", "--json"])
    result = json.loads(capsys.readouterr().out)["PPO"]
    assert set(result) == METRIC_NAMES
    assert result["median"]["value"] == pytest.approx(0.75)
    assert result["mean"]["value"] == pytest.approx(0.75)
    for estimate in result.values():
        assert estimate["ci"][0] <= estimate["value"] <= estimate["ci"][1]
    main(["aggregate", "--scores", str(scores), "--reps", "50"])
    header, row, _ = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["algorithm", "games", "runs", "Median"]
    assert row.split()[:4] == ["PPO", "2", "4", "0.750"]


def test_plot_writes_every_figure(tmp_path):
    runs = tmp_path / "runs"
    rng = np.random.default_rng(0)
    for exp_name in ("cleanba_ppo", "cleanba_impala"):
        for env_id in ("Breakout-v5", "Pong-v5"):
            for seed in (1, 2):
                write_run(
                    runs_dir=runs,
                    exp_name=exp_name,
                    env_id=env_id,
                    seed=seed,
                    returns=rng.uniform(-20, 30, size=20).round(),
                )
    scores = tmp_path / "scores.csv"
    curves = tmp_path / "curves.csv"
    plots = tmp_path / "plots"
    main(
        [
            "collect",
            "--runs-dir",
            str(runs),
            "--scores-out",
            str(scores),
            "--curves-out",
            str(curves),
        ]
    )
    main(
        [
            "plot",
            "--scores",
            str(scores),
            "--curves",
            str(curves),
            "--out-dir",
            str(plots),
            "--reps",
            "20",
        ]
    )
    names = [
        "hns_vs_steps",
        "hns_vs_wall_time",
        "aggregate_intervals",
        "performance_profile",
        "per_game_curves",
    ]
    for name in names:
        assert (plots / f"{name}.png").stat().st_size > 0


@pytest.mark.parametrize(
    "scores_csv, args, expected",
    [
        pytest.param(
            None,
            ["aggregate", "--scores", "{tmp}/no.csv"],
            "no.csv does not exist",
            id="missing file",
        ),
        pytest.param(
            "algorithm,env_id,score\nPPO,Pong-v5,1\n",
            ["aggregate", "--scores", "{tmp}/scores.csv"],
            "lacks the column(s) seed",
            id="bad columns",
        ),
        pytest.param(
            SCORES_HEADER + "PPO,CartPole-v1,1,500\n",
            ["aggregate", "--scores", "{tmp}/scores.csv"],
            "'CartPole-v1' is not one of the 57 Atari games",
            id="unknown game",
        ),
        pytest.param(
            SCORES_HEADER,
            ["aggregate", "--scores", "{tmp}/scores.csv"],
            "has no rows",
            id="no scores",
        ),
        pytest.param(
            None, ["aggregate"], "arguments are required: --scores", id="missing argument"
        ),
        pytest.param(
            None, ["collect", "--runs-dir", "{tmp}/runs"], "has no run folders", id="empty runs dir"
        ),
        pytest.param(
            None,
            ["collect", "--runs-dir", "{tmp}/runs", "--label", "ppo"],
            "is not EXP_NAME=LABEL",
            id="bad label",
        ),
    ],
)
def test_cli_mistakes_are_one_line_with_exit_code_2(tmp_path, scores_csv, args, expected):
    (tmp_path / "runs").mkdir()
    if scores_csv is not None:
        (tmp_path / "scores.csv").write_text(scores_csv)
    command = [
        sys.executable,
        "-m",
        "cleanba_utils.experiments.hns",
        *(arg.format(tmp=tmp_path) for arg in args),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert expected in result.stderr
