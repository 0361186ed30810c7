"""Report on one launcher experiment: SLM Lab's metrics and graphs, trial ranking, per-env metrics,
learning curves and search history.

    python -m cleanba_utils.experiments.analyze runs/_experiments/NAME [--out-dir DIR] \\
        [--last-n 100] [--reps 2000] [--seed 0] [--json] \\
        [--measure-random-baseline [--random-episodes 100]]

writes report.md, the PNGs and sessions/<run name>.csv into --out-dir (default: the experiment
folder) and prints the report's path, or with --json SLM Lab's metrics per env, trial and session
(null where a metric has no value; the trial's notes say why); the runs are the TensorBoard folders
runs/<run_name>/ two levels above the experiment folder. Each env's random baseline, and where it
came from, is printed on stderr.

A session is one run (one seed) of a trial on one env.

- random: the env's random baseline (random_baseline.py): spec["random_scores"][env] if given, else
  the published random score of the 57 Atari games, else the mean return of uniformly random play
  measured with envpool and cached in the experiment folder. With --measure-random-baseline, SLM
  Lab's: the mean return of --random-episodes episodes of uniformly random play in the
  environments of the experiment's training script (its command's script and flags), for every
  env, Atari included, printed beside the published Atari random score; cached in the experiment
  folder too.
- SLM Lab's metrics (slm_metrics.py, slm_report.py), from the evaluations during training
  (charts/eval_return, charts/opt_step): per session final_return_ma, strength, max_strength,
  final_strength, sample_efficiency, training_efficiency, stability, per trial their means and
  consistency. Trials are listed by strength, as in SLM Lab's experiment table; the experiment
  graph and a trial graph per trial go with them. Runs without evaluations have none.

The other metrics are computed on the curve of a session: the running mean of its last --last-n
episodic returns, against global step (or wall time since the run's first event). A trial's value
is the mean over sessions.

- Curves of a trial on an env: each session's curve on 100 grid points from 0 to the largest step
  (wall time) of any of the trial's sessions, as a step function: the last value at or before a grid
  point, NaN before the session's first episode (after its last, the last value holds: sessions end
  a few steps apart). The mean ignores NaN; its band is the 2.5-97.5 percentile interval of --reps
  bootstrap resamples of the sessions (numpy generator seeded by --seed).
- final_return: the mean of a session's last --last-n episodic returns.
- auc: the mean of a session's grid curve over the grid points (NaN ignored), the area under the
  curve per step; shown normalized between random (0) and the best trial's auc on the env (1).
- steps_to_threshold: the first global step at which a session's curve reaches the threshold,
  spec["thresholds"][env] if given, else halfway between random and the best trial's final_return;
  the mean over the sessions that did.
- retention: (final - random) / (best - random), best and final being the maximum and last value of
  a session's curve, clipped to [0, 1] (1: it keeps its best); NaN if best <= random.
- agreement: 1 - std(final_return over sessions) / (best trial's final_return - random), clipped
  to [0, 1].
- sps: a session's last global step / its last wall time.
Trials are ranked by the experiment's metric (final_return or auc) with a 95% bootstrap interval
over sessions; with several envs by the mean over envs of the metric normalized per env between
random (0) and the best trial (1), each env resampling its own sessions. If every env is an Atari
game, human-normalized scores are aggregated as in hns.py.
"""

import argparse
import json
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import optuna

from cleanba_utils.errors import fail
from cleanba_utils.experiments import cli, hns, slm_metrics, slm_report
from cleanba_utils.experiments.events import GRID_POINTS, read_scalars, running_mean
from cleanba_utils.experiments.figures import save_figure
from cleanba_utils.experiments.random_baseline import (
    SCRIPT_EPISODES,
    random_baseline,
    training_script,
    under_script,
)
from cleanba_utils.experiments.spec import METRICS

X_AXES = {"steps": ("steps", "global step"), "wall_time": ("wall_times", "wall time (s)")}


def on_grid(x, curve, grid):
    """`curve`, logged at `x`, as a step function on `grid`: NaN before its first point."""
    order = np.argsort(x, kind="stable")  # actor threads log wall times slightly out of step order
    x = np.asarray(x)[order]
    curve = np.asarray(curve, float)[order]
    index = np.searchsorted(x, grid, side="right") - 1
    values = curve[np.maximum(index, 0)]
    values[index < 0] = np.nan
    return values


def mean_band(curves, reps, seed):
    """Mean over the rows (sessions) of grid curves and its 95% bootstrap band, NaN ignored."""
    samples = curves[np.random.default_rng(seed).integers(len(curves), size=(reps, len(curves)))]
    low, high = np.nanpercentile(np.nanmean(samples, axis=1), [2.5, 97.5], axis=0)
    return np.nanmean(curves, axis=0), low, high


def final_return(returns, last_n):
    return float(np.mean(returns[-last_n:]))


def auc(steps, curve, grid):
    return float(np.nanmean(on_grid(steps, curve, grid)))


def normalize(value, random, best):
    """0 at `random`, 1 at `best`; NaN when best is no better than random."""
    return (value - random) / (best - random) if best > random else value * np.nan


def steps_to_threshold(steps, curve, threshold):
    """The first step at which `curve` reaches `threshold`; NaN if it never does."""
    reached = np.flatnonzero(np.asarray(curve) >= threshold)
    return float(steps[reached[0]]) if len(reached) else np.nan


def retention(curve, random):
    """How much of its best a session keeps at its end, over random: (final - random) / (best -
    random) clipped to [0, 1]; NaN if best <= random. Not SLM Lab's stability."""
    best = np.max(curve)
    final = curve[-1]
    return float(np.clip((final - random) / (best - random), 0, 1)) if best > random else np.nan


def agreement(finals, random, best):
    """1 - std(final returns over sessions) / (best - random) clipped to [0, 1]; 1 for one session.
    Not SLM Lab's consistency."""
    if len(finals) == 1:
        return 1.0
    return float(np.clip(1 - np.std(finals) / (best - random), 0, 1)) if best > random else np.nan


def sps(steps, wall_times):
    return steps[-1] / wall_times[-1] if wall_times[-1] > 0 else np.nan


def bootstrap_score(per_env, references, reps, seed):
    """(score, low, high): the mean over envs of each env's mean session value normalized by its
    (random, best) reference, and its 95% bootstrap interval; every env resamples its own sessions
    so none drops out."""
    rng = np.random.default_rng(seed)
    points = []
    samples = []
    for values, (random, best) in zip(per_env, references):
        resampled = values[rng.integers(len(values), size=(reps, len(values)))]
        points.append(normalize(np.nanmean(values), random, best))
        samples.append(normalize(np.nanmean(resampled, axis=1), random, best))
    low, high = np.nanpercentile(np.nanmean(samples, axis=0), [2.5, 97.5])
    return float(np.nanmean(points)), float(low), float(high)


class Trial(NamedTuple):
    number: int
    params: dict
    state: str
    value: float | None
    runs: list  # (run_name, env_id)


class Session(NamedTuple):
    steps: np.ndarray
    wall_times: np.ndarray
    returns: np.ndarray
    curve: np.ndarray


class EnvResult(NamedTuple):
    values: dict  # {metric: {trial number: per-session values}}
    references: dict  # {metric: (random, the best trial's value)}
    description: str
    rows: dict  # {trial number: metrics table row}


def read_experiment(directory):
    """(header, spec, trials) from the experiment.json the launcher wrote."""
    path = directory / "experiment.json"
    if not directory.is_dir():
        raise ValueError(
            f"{directory} is not a folder; pass an experiment folder, runs/_experiments/<NAME>"
        )
    if not path.is_file():
        raise ValueError(
            f"{path} does not exist; pass the folder the launcher wrote for an experiment"
        )
    try:
        record = json.loads(path.read_text())
        header = {
            key: str(record.get(key, "unknown"))
            for key in ("experiment", "git_sha", "method", "metric")
        }
        trials = [
            Trial(
                number=int(t["number"]),
                params=dict(t["params"]),
                state=str(t["state"]),
                value=None if t.get("value") is None else float(t["value"]),
                runs=[(str(run["run_name"]), str(run["env_id"])) for run in t["runs"]],
            )
            for t in record["trials"]
        ]
        spec = dict(record.get("spec") or {})
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{path} is not an experiment record as the launcher writes it ({error!r})"
        ) from None
    if header["metric"] not in METRICS:
        raise ValueError(
            f"{path} has metric {header['metric']!r}; this report ranks by {' or '.join(METRICS)}"
        )
    return header, spec, trials


def load_sessions(runs_dir, trials, last_n, notes):
    """{(trial number, env_id): [Session]}; runs without an episode are noted and skipped."""
    sessions = {}
    for trial in trials:
        for run_name, env_id in trial.runs:
            logged = read_scalars(runs_dir / run_name)
            if not len(logged.steps):
                notes.append(f"{run_name} (trial {trial.number}) has logged no episode; skipped")
                continue
            session = Session(*logged, running_mean(logged.values, last_n))
            sessions.setdefault((trial.number, env_id), []).append(session)
    return sessions


def fmt(value, spec=".4g"):
    return "–" if value is None or not np.isfinite(value) else format(value, spec)


def analyze_env(env_id, by_trial, spec, baseline, last_n):
    """The metrics of the trials in `by_trial` ({number: [Session]}) on one env; `baseline` is its
    RandomBaseline."""
    random = baseline.mean
    finals = {
        n: np.array([final_return(s.returns, last_n) for s in ss]) for n, ss in by_trial.items()
    }
    grids = {
        n: np.linspace(0, max(s.steps[-1] for s in ss), GRID_POINTS) for n, ss in by_trial.items()
    }
    aucs = {
        n: np.array([auc(s.steps, s.curve, grids[n]) for s in ss]) for n, ss in by_trial.items()
    }
    values = {"final_return": finals, "auc": aucs}
    references = {
        m: (random, np.nanmax([np.nanmean(v) for v in values[m].values()])) for m in METRICS
    }
    best = references["final_return"][1]
    thresholds = spec.get("thresholds") or {}
    threshold = float(thresholds.get(env_id, (random + best) / 2))
    threshold_source = (
        "spec thresholds"
        if env_id in thresholds
        else "halfway from random to the best final_return"
    )
    description = (
        f"random = {fmt(random)} ({baseline.source}); "
        f"threshold = {fmt(threshold)} ({threshold_source})."
    )
    rows = {}
    for n, ss in by_trial.items():
        hit = [
            step for s in ss if np.isfinite(step := steps_to_threshold(s.steps, s.curve, threshold))
        ]
        rows[n] = [
            f"#{n}",
            str(len(ss)),
            fmt(finals[n].mean()),
            fmt(normalize(np.nanmean(aucs[n]), *references["auc"])),
            f"{fmt(np.mean(hit) if hit else None, ',.0f')} ({len(hit)}/{len(ss)} reached)",
            fmt(np.nanmean([retention(s.curve, random) for s in ss])),
            fmt(agreement(finals[n], random, best)),
            fmt(np.nanmean([sps(s.steps, s.wall_times) for s in ss]), ",.0f"),
        ]
    return EnvResult(values, references, description, rows)


def describe(params, limit=None):
    text = ", ".join(f"{name.lstrip('-')}={value}" for name, value in params.items()) or "defaults"
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return [*lines, *("| " + " | ".join(row) + " |" for row in rows)]


def plot_curves(env_id, by_trial, labels, axis, reps, seed, path):
    """Each trial's mean curve and 95% bootstrap band against `axis` (a key of X_AXES)."""
    field, xlabel = X_AXES[axis]
    fig, ax = plt.subplots(figsize=(9, 5), layout="constrained")
    for i, (number, sessions) in enumerate(by_trial.items()):
        xs = [getattr(s, field) for s in sessions]
        grid = np.linspace(0, max(x.max() for x in xs), GRID_POINTS)
        mean, low, high = mean_band(
            np.stack([on_grid(x, s.curve, grid) for x, s in zip(xs, sessions)]), reps, seed
        )
        ax.plot(grid, mean, color=f"C{i}", label=labels[number])
        ax.fill_between(grid, low, high, color=f"C{i}", alpha=0.2)
    ax.set(
        title=f"{env_id}: mean over sessions, 95% bootstrap band",
        xlabel=xlabel,
        ylabel="episodic return (mean)",
    )
    ax.legend(fontsize="small")
    save_figure(fig, path)


def read_study(header, experiment_dir):
    """(the Optuna study or None, parameter importance lines) of a tpe experiment."""
    journal = experiment_dir / "study.journal"
    study = None
    if not journal.is_file():
        return None, [f"No {journal.name}, so no parameter importances."]
    try:
        storage = optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(journal))
        )
        study = optuna.load_study(study_name=header["experiment"], storage=storage)
        if len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))) < 2:
            return study, [
                "Parameter importances: not enough complete trials (at least 2 are needed)."
            ]
        # The default evaluator, fANOVA, needs scikit-learn, which cleanba does not depend on;
        # PED-ANOVA needs numpy.
        evaluator = optuna.importance.PedAnovaImportanceEvaluator()
        importances = optuna.importance.get_param_importances(study, evaluator=evaluator)
    except Exception as error:  # e.g. every objective value is the same
        return study, [f"Parameter importances could not be computed: {error!r}"]
    rows = [[name, f"{importance:.3f}"] for name, importance in importances.items()]
    return study, table(["parameter", "importance (PED-ANOVA)"], rows)


def plot_history(header, trials, study, path):
    """Objective per trial; a pruned trial shows its value, else the last value it reported to the
    study."""
    reported = [t for t in study.trials if t.intermediate_values] if study else []
    last = {t.number: t.intermediate_values[max(t.intermediate_values)] for t in reported}
    points = [
        (t.number, last.get(t.number) if t.value is None else t.value, t.state == "pruned")
        for t in trials
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    for pruned, marker, label in ((False, "o", "objective"), (True, "x", "pruned (last value)")):
        if shown := [(n, value) for n, value, p in points if p == pruned and value is not None]:
            ax.plot(*zip(*shown), marker, color="C3" if pruned else "C0", label=label)
    if ax.has_data():
        ax.legend()
    else:
        ax.text(
            0.5, 0.5, "no trial has an objective value yet", ha="center", transform=ax.transAxes
        )
    ax.set(
        title=f"{header['experiment']}: objective per trial",
        xlabel="trial",
        ylabel=header["metric"],
    )
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    save_figure(fig, path)


def hns_lines(results, order, reps, seed):
    finals = {env: result.values["final_return"] for env, result in results.items()}
    by_trial = {
        f"#{n}": {env: hns.human_normalized(env, f[n]) for env, f in finals.items() if n in f}
        for n in order
    }
    rows = [
        [
            label,
            *(f"{value:.3f} [{low:.3f}, {high:.3f}]" for value, (low, high) in estimates.values()),
        ]
        for label, estimates in hns.aggregate(by_trial, reps, seed).items()
    ]
    note = "Human-normalized final_return with 95% stratified bootstrap CIs."
    return [
        "## Human-normalized scores",
        "",
        note,
        "",
        *table(["trial", *hns.LABELS.values()], rows),
        "",
    ]


def rank(trials, results, metric, reps, seed):
    """[(trial, (score, low, high))] best first, of the trials in `results`."""
    several = len(results) > 1
    ranked = []
    for trial in trials:
        if not (envs := [env for env, r in results.items() if trial.number in r.values[metric]]):
            continue
        references = [results[env].references[metric] if several else (0.0, 1.0) for env in envs]
        per_env = [results[env].values[metric][trial.number] for env in envs]
        ranked.append((trial, bootstrap_score(per_env, references, reps, seed)))
    return sorted(ranked, key=lambda item: -item[1][0] if np.isfinite(item[1][0]) else np.inf)


def ranking_lines(header, trials, ranked, sessions, several):
    rows = []
    for place, (trial, (score, low, high)) in enumerate(ranked, start=1):
        last_step = max(
            s.steps[-1] for (n, _), ss in sessions.items() if n == trial.number for s in ss
        )
        state = f"pruned, ran to step {last_step:,}" if trial.state == "pruned" else trial.state
        interval = f"{fmt(score)} [{fmt(low)}, {fmt(high)}]"
        rows.append([str(place), f"#{trial.number}", describe(trial.params), interval, state])
    unranked = [t for t in trials if t.number not in {trial.number for trial, _ in ranked}]
    rows += [
        ["–", f"#{t.number}", describe(t.params), "–", f"{t.state}, not ranked"] for t in unranked
    ]
    metric = f"{header['metric']} (normalized, mean over envs)" if several else header["metric"]
    return [
        "## Ranking",
        "",
        *table(["rank", "trial", "params", f"{metric}, 95% CI", "state"], rows),
        "",
    ]


def baseline_text(baseline):
    if not baseline.episodes:
        return f"{fmt(baseline.mean)} ({baseline.source})"
    text = f"{fmt(baseline.mean)} +- {fmt(baseline.standard_error, '.2g')} ({baseline.source})"
    if np.isfinite(baseline.published_score):
        text += f"; published Atari random score {fmt(baseline.published_score)}"
    return text


def slm_lines(env_id, baseline, results, trials, graphs):
    """The SLM Lab section of one env: its trials ranked by strength, their sessions, the graphs."""
    params = {trial.number: trial.params for trial in trials}
    rows = []
    session_rows = []
    for place, number in enumerate(slm_report.by_strength(results), start=1):
        result = results[number]
        metrics = [fmt(result.metrics[name]) for name in slm_metrics.TRIAL_METRICS]
        rows.append(
            [
                str(place),
                f"#{number}",
                describe(params[number]),
                str(len(result.sessions)),
                *metrics,
            ]
        )
        for session in result.sessions:
            values = [fmt(session.metrics[name]) for name in slm_metrics.SESSION_METRICS]
            session_rows.append([f"#{number}", session.run_name, str(session.evaluations), *values])
    notes = sorted({note for result in results.values() for note in result.notes})
    lines = [
        f"## SLM Lab metrics on {env_id}",
        "",
        f"Random baseline R_rand = {baseline_text(baseline)}. Trials ranked by strength, as SLM "
        "Lab's experiment table; each session's series (frame, opt_step, total_reward) is in "
        "sessions/.",
        "",
        *table(["rank", "trial", "params", "sessions", *slm_metrics.TRIAL_METRICS], rows),
        "",
        *(f"- {note}" for note in notes),
        *([""] if notes else []),
        *table(["trial", "session", "evaluations", *slm_metrics.SESSION_METRICS], session_rows),
        "",
    ]
    for name, text in graphs:
        lines += [f"![{text}]({name})", ""]
    return lines


def slm_section(env_id, by_trial, baseline, trials, title, out_dir):
    """(TrialResults, report lines) of one env; writes the session CSVs and the graphs."""
    results = slm_report.trial_results_of_env(env_id, by_trial, baseline.mean, out_dir)
    params = {trial.number: trial.params for trial in trials}
    env_name = slm_report.safe_name(env_id)
    graphs = [(f"experiment_graph_{env_name}.png", f"experiment graph on {env_id}")]
    slm_report.plot_experiment_graph(
        f"{title} on {env_id}", results, params, out_dir / graphs[0][0]
    )
    for number in slm_report.by_strength(results):
        name = f"trial_graph_{env_name}_t{number}.png"
        slm_report.plot_trial_graph(
            f"{title} t{number} on {env_id}", by_trial[number], baseline.mean, out_dir / name
        )
        graphs.append((name, f"trial graph of #{number} on {env_id}"))
    return results, slm_lines(env_id, baseline, results, trials, graphs)


def write_report(args):
    """Writes the report, its PNGs and the session CSVs; returns (the report's path, what --json
    prints)."""
    header, spec, trials = read_experiment(args.experiment_dir)
    runs_dir = args.experiment_dir.parent.parent
    out_dir = args.out_dir or args.experiment_dir
    notes = []
    sessions = load_sessions(runs_dir, trials, args.last_n, notes)
    series = slm_report.load_series(runs_dir, trials, notes)
    if not sessions and not series:
        raise ValueError(
            f"no run of experiment {header['experiment']} under {runs_dir} has logged an episode "
            "yet"
        )
    script = None
    if args.measure_random_baseline:
        # The launcher runs the command in the folder that holds runs/.
        script = training_script(str(spec.get("command", "")), runs_dir.parent)
    out_dir.mkdir(parents=True, exist_ok=True)
    baselines = {}
    for env in sorted({env for _, env in [*sessions, *series]}):
        if script is None:
            baselines[env] = random_baseline(env, spec, args.experiment_dir)
        else:
            episodes = args.random_episodes or SCRIPT_EPISODES
            baselines[env] = under_script(env, script, episodes, args.experiment_dir)
        cli.info(f"random baseline of {env}: {baseline_text(baselines[env])}", prog="analyze")
    results = {}
    active = [t.number for t in trials if t.state != "failed"]
    for env in sorted({env for _, env in sessions}):
        by_trial = {n: sessions[n, env] for n in active if (n, env) in sessions}
        if by_trial:
            results[env] = analyze_env(
                env_id=env,
                by_trial=by_trial,
                spec=spec,
                baseline=baselines[env],
                last_n=args.last_n,
            )
    slm_results = {}
    slm_text = []
    for env in sorted({env for _, env in series}):
        by_trial = {n: series[n, env] for n in active if (n, env) in series}
        if by_trial:
            slm_results[env], lines = slm_section(
                env_id=env,
                by_trial=by_trial,
                baseline=baselines[env],
                trials=trials,
                title=header["experiment"],
                out_dir=out_dir,
            )
            slm_text += lines
    ranked = rank(
        trials=trials, results=results, metric=header["metric"], reps=args.reps, seed=args.seed
    )
    lines = [f"# Experiment {header['experiment']}", ""]
    lines += [
        f"git SHA `{header['git_sha']}`, method {header['method']}, metric {header['metric']}.",
        "",
        *slm_text,
    ]
    lines += ranking_lines(
        header=header,
        trials=trials,
        ranked=ranked,
        sessions=sessions,
        several=len(results) > 1,
    )
    order = [trial.number for trial, _ in ranked]
    labels = {trial.number: f"#{trial.number} {describe(trial.params, 50)}" for trial, _ in ranked}
    columns = [
        "trial",
        "sessions",
        "final_return",
        "auc (normalized)",
        "steps_to_threshold",
        "retention",
    ]
    for env, result in results.items():
        lines += [f"## {env}", "", result.description, ""]
        lines += [
            *table(
                [*columns, "agreement", "sps"],
                [result.rows[n] for n in order if n in result.rows],
            ),
            "",
        ]
        plotted = {n: sessions[n, env] for n in order if n in result.rows}
        for axis, (_, xlabel) in X_AXES.items():
            name = f"curves_{re.sub(r'[^A-Za-z0-9_.-]', '_', env)}_{axis}.png"
            plot_curves(
                env_id=env,
                by_trial=plotted,
                labels=labels,
                axis=axis,
                reps=args.reps,
                seed=args.seed,
                path=out_dir / name,
            )
            lines += [f"![{env} against {xlabel}]({name})", ""]
    if results and all(env in hns.reference_scores() for env in results):
        lines += hns_lines(results, order, args.reps, args.seed)
    study, importances = (
        read_study(header, args.experiment_dir) if header["method"] == "tpe" else (None, [])
    )
    plot_history(header, trials, study, out_dir / "history.png")
    lines += ["## Search history", "", "![objective per trial](history.png)", "", *importances, ""]
    if notes:
        lines += ["## Warnings", "", *(f"- {note}" for note in notes), ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    record = {
        "experiment": header["experiment"],
        "report": str(path),
        "envs": slm_report.json_record(slm_results, baselines, trials, out_dir),
        "notes": notes,
    }
    return path, record


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cleanba_utils.experiments.analyze", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "experiment_dir", type=Path, help="runs/_experiments/<NAME>, written by the launcher"
    )
    parser.add_argument(
        "--out-dir", type=Path, help="folder for report.md and the PNGs (default: EXPERIMENT_DIR)"
    )
    parser.add_argument(
        "--last-n", type=cli.positive_int, default=100, help="episodes averaged per curve point"
    )
    parser.add_argument("--reps", type=cli.positive_int, default=2000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print SLM Lab's metrics per trial and session as JSON instead of the report's path",
    )
    parser.add_argument(
        "--measure-random-baseline",
        action="store_true",
        help="take each env's random baseline as SLM Lab does, from episodes of uniformly random "
        "play in the environments of the experiment's training script (Atari included), instead "
        "of the spec's random_scores, the published Atari score or envpool's defaults",
    )
    parser.add_argument(
        "--random-episodes",
        type=cli.positive_int,
        help=f"with --measure-random-baseline: episodes played (default {SCRIPT_EPISODES}, SLM "
        "Lab's)",
    )
    cli.one_line_errors(parser, "analyze")
    args = parser.parse_args(argv)
    if args.random_episodes is not None and not args.measure_random_baseline:
        parser.error("--random-episodes needs --measure-random-baseline")
    try:
        # NaN means where no session has an episode yet are by design, and optuna's warnings on
        # small studies would interleave with the one line this command prints.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter("ignore", UserWarning)
            path, record = write_report(args)
            print(json.dumps(record, indent=1) if args.json else path)
    except ValueError as error:
        fail(str(error), prog="analyze")


if __name__ == "__main__":
    main()
