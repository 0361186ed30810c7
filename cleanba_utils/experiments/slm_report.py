"""The SLM Lab part of an experiment's report: each session's evaluation series (read from its
TensorBoard events, written as a CSV), the eight metrics of slm_metrics.py per session and per
trial, the trials ranked by strength as SLM Lab's experiment table ranks them, and SLM Lab's two
graphs: the experiment graph (each metric against each searched flag, one point per trial, colored
by strength) and the trial graph (each session's evaluation returns, and their mean +- one sample
standard deviation over sessions, against frames).

The series of a run: `charts/eval_return` at the global step of each evaluation (the scripts'
--eval-every), and `charts/opt_step`, the optimizer steps so far, logged at the same step. A run
without `charts/eval_return` has no series; a series without `charts/opt_step` at some evaluation
has opt_step NaN there, and its training_efficiency is NaN.
"""

import csv
import math
import re
from pathlib import Path
from typing import NamedTuple

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from cleanba_utils.experiments import slm_metrics
from cleanba_utils.experiments.events import EVAL_RETURN, OPT_STEP, read_tags
from cleanba_utils.experiments.figures import save_figure
from cleanba_utils.experiments.slm_metrics import SESSION_COLUMNS, TRIAL_METRICS, SessionSeries

NO_OPT_STEP = (
    f"training_efficiency is NaN: a session logged no {OPT_STEP} (optimizer steps) at some of its "
    "evaluations"
)


class RunSeries(NamedTuple):
    run_name: str
    series: SessionSeries


class SessionResult(NamedTuple):
    run_name: str
    csv_path: Path
    evaluations: int
    metrics: dict  # slm_metrics.SESSION_METRICS


class TrialResult(NamedTuple):
    number: int
    env_id: str
    metrics: dict  # slm_metrics.TRIAL_METRICS
    sessions: list  # [SessionResult]
    notes: list  # why a metric is NaN


def read_series(run_dir: Path) -> SessionSeries | None:
    """The run's evaluation series; None if it logged no evaluation."""
    logged = read_tags(run_dir, (EVAL_RETURN, OPT_STEP))
    returns = logged[EVAL_RETURN]
    if not len(returns.steps):
        return None
    opt_steps = dict(zip(logged[OPT_STEP].steps.tolist(), logged[OPT_STEP].values.tolist()))
    return SessionSeries(
        frame=returns.steps,
        opt_step=np.array([opt_steps.get(step, np.nan) for step in returns.steps.tolist()]),
        total_reward=returns.values,
    )


def load_series(runs_dir: Path, trials, notes: list) -> dict:
    """{(trial number, env_id): [RunSeries]} of the trials' runs that logged evaluations; the
    trials none of whose runs did are noted."""
    by_trial = {}
    without = []
    for trial in trials:
        for run_name, env_id in trial.runs:
            series = read_series(runs_dir / run_name)
            if series is not None:
                by_trial.setdefault((trial.number, env_id), []).append(RunSeries(run_name, series))
        if trial.runs and not any((trial.number, env) in by_trial for _, env in trial.runs):
            without.append(f"#{trial.number}")
    if without:
        notes.append(
            f"no SLM Lab metrics for trial(s) {', '.join(without)}: no run logged {EVAL_RETURN} "
            "(evaluations during training, the scripts' --eval-every)"
        )
    return by_trial


def write_series_csv(series: SessionSeries, path: Path):
    """frame, opt_step, total_reward; an opt_step that was not logged is written as nan."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(SESSION_COLUMNS)
        for frame, opt_step, total_reward in zip(*series):
            opt_text = "nan" if np.isnan(opt_step) else str(int(opt_step))
            writer.writerow([int(frame), opt_text, repr(float(total_reward))])


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def trial_results_of_env(env_id: str, by_trial: dict, random_return: float, out_dir: Path) -> dict:
    """{trial number: TrialResult} of the trials in `by_trial` ({number: [RunSeries]}); writes
    each session's series to out_dir/sessions/<run name>.csv."""
    results = {}
    for number, runs in by_trial.items():
        sessions = []
        for run in runs:
            path = out_dir / "sessions" / f"{safe_name(run.run_name)}.csv"
            write_series_csv(run.series, path)
            metrics = slm_metrics.session_metrics(run.series, random_return)
            sessions.append(SessionResult(run.run_name, path, len(run.series.frame), metrics))
        notes = []
        if any(np.isnan(run.series.opt_step).any() for run in runs):
            notes.append(NO_OPT_STEP)
        if len(runs) == 1:
            notes.append("consistency is NaN: one session has no spread over sessions")
        results[number] = TrialResult(
            number=number,
            env_id=env_id,
            metrics=slm_metrics.trial_metrics([run.series for run in runs], random_return),
            sessions=sessions,
            notes=notes,
        )
    return results


def by_strength(results: dict) -> list[int]:
    """Trial numbers, highest strength first (SLM Lab's experiment table order), NaN last."""
    return sorted(
        results,
        key=lambda n: (
            -results[n].metrics["strength"]
            if np.isfinite(results[n].metrics["strength"])
            else math.inf
        ),
    )


def finite_or_none(value):
    """JSON has no NaN: a metric without a value is null."""
    return float(value) if np.isfinite(value) else None


def json_record(results_by_env: dict, baselines: dict, trials, out_dir: Path) -> dict:
    """What `analyze --json` prints: per environment its random baseline (with the published Atari
    random score, null for another task), and per trial and session the metrics (null: no value,
    the trial's notes say why)."""
    params = {trial.number: trial.params for trial in trials}
    states = {trial.number: trial.state for trial in trials}
    record = {}
    for env_id, results in results_by_env.items():
        baseline = baselines[env_id]
        record[env_id] = {
            "random_baseline": {
                "mean": baseline.mean,
                "standard_error": finite_or_none(baseline.standard_error),
                "std": finite_or_none(baseline.std),
                "episodes": baseline.episodes,
                "source": baseline.source,
                "published_score": finite_or_none(baseline.published_score),
            },
            "ranking_by_strength": by_strength(results),
            "trials": [
                {
                    "number": number,
                    "params": params[number],
                    "state": states[number],
                    "metrics": {k: finite_or_none(v) for k, v in results[number].metrics.items()},
                    "notes": results[number].notes,
                    "sessions": [
                        {
                            "run_name": session.run_name,
                            "series_csv": str(session.csv_path.relative_to(out_dir)),
                            "evaluations": session.evaluations,
                            "metrics": {k: finite_or_none(v) for k, v in session.metrics.items()},
                        }
                        for session in results[number].sessions
                    ],
                }
                for number in by_strength(results)
            ],
        }
    return record


def numeric(values: list[str]):
    """The values as floats, or None if one is not a number."""
    try:
        return [float(value) for value in values]
    except ValueError:
        return None


def plot_experiment_graph(title: str, results: dict, params: dict, path: Path):
    """SLM Lab's experiment graph: a row per metric, a column per searched flag (the trial number
    when nothing was searched), a point per trial colored by its strength (dark: strong)."""
    numbers = list(results)
    flags = sorted({flag for n in numbers for flag in params[n]}) or ["trial"]
    strengths = np.array([results[n].metrics["strength"] for n in numbers])
    known = strengths[np.isfinite(strengths)]
    high = known.max() if len(known) else 1.0
    low = known.min() if len(known) else 0.0
    # As SLM Lab's: the palest part of the color scale left out, so that every point shows.
    norm = matplotlib.colors.Normalize(vmin=low - 0.5 * (high - low) - 1e-9, vmax=high + 1e-9)
    fig, axes = plt.subplots(
        len(TRIAL_METRICS),
        len(flags),
        figsize=(1.5 + 3 * len(flags), 1.0 + 1.9 * len(TRIAL_METRICS)),
        sharex="col",
        squeeze=False,
        layout="constrained",
    )
    for column, flag in enumerate(flags):
        texts = [str(n) if flag == "trial" else str(params[n].get(flag, "–")) for n in numbers]
        values = numeric(texts)
        if values is None:
            categories = sorted(set(texts))
            values = [categories.index(text) for text in texts]
            axes[-1, column].set_xticks(range(len(categories)), categories, rotation=30)
        elif min(values) > 0 and max(values) >= 10 * min(values) and flag != "trial":
            axes[-1, column].set_xscale("log")
        for row, metric in enumerate(TRIAL_METRICS):
            ax = axes[row, column]
            ax.scatter(
                values,
                [results[n].metrics[metric] for n in numbers],
                c=strengths,
                cmap="YlGnBu",
                norm=norm,
                edgecolors="k",
                linewidths=0.5,
            )
            if not np.isfinite([results[n].metrics[metric] for n in numbers]).any():
                ax.text(0.5, 0.5, "no value (NaN)", ha="center", transform=ax.transAxes)
            if column == 0:
                ax.set_ylabel(metric, fontsize="small")
        axes[-1, column].set_xlabel(flag.lstrip("-"))
    fig.suptitle(f"experiment graph: {title}")
    save_figure(fig, path)


def plot_trial_graph(title: str, runs: list, random_return: float, path: Path):
    """SLM Lab's trial graph of returns: each session's evaluation returns (thin), their mean over
    sessions at each checkpoint and a band of +- one sample standard deviation, against frames."""
    longest = max(runs, key=lambda run: len(run.series.frame)).series.frame
    table = np.full((len(runs), len(longest)), np.nan)
    for row, run in zip(table, runs):
        row[: len(run.series.total_reward)] = run.series.total_reward
    mean = np.nanmean(table, axis=0)
    counts = (~np.isnan(table)).sum(axis=0)
    std = np.zeros(len(longest))
    several = counts >= 2
    std[several] = np.nanstd(table[:, several], axis=0, ddof=1)
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for i, run in enumerate(runs):
        ax.plot(
            run.series.frame,
            run.series.total_reward,
            color="0.6",
            linewidth=0.8,
            label="sessions" if i == 0 else None,
        )
    ax.plot(longest, mean, color="C0", label=f"mean of {len(runs)} sessions")
    ax.fill_between(longest, mean - std, mean + std, color="C0", alpha=0.2, label="+- 1 std")
    ax.axhline(random_return, color="C3", linestyle="--", linewidth=0.8, label="random baseline")
    ax.set(title=f"trial graph: {title}", xlabel="frames (global step)", ylabel="eval return")
    ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter())
    ax.legend(fontsize="small")
    save_figure(fig, path)
