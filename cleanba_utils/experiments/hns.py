"""Human-normalized scores (HNS) of Atari runs: collect them from run folders, aggregate them with
stratified bootstrap confidence intervals, and plot them.

    python -m cleanba_utils.experiments.hns collect --runs-dir runs --scores-out scores.csv \\
        --curves-out curves.csv
    python -m cleanba_utils.experiments.hns aggregate --scores scores.csv
    python -m cleanba_utils.experiments.hns plot --scores scores.csv --curves curves.csv \\
        --out-dir plots

The metrics follow Agarwal et al. (2021), "Deep Reinforcement Learning at the Edge of the
Statistical Precipice": median and mean are taken over games of each game's mean HNS across seeds;
IQM (25% trimmed mean) and optimality gap (gamma = 1) are taken over all (seed, game) scores. When
games have different numbers of seeds, each game's seeds are repeated up to a common count (the
least common multiple of the counts) so that every game weighs the same; with equal seeds this is
exactly the (runs, games) matrix rliable expects. Confidence intervals are 95% percentile intervals
of a stratified bootstrap in which every game resamples its own seeds with replacement.
"""

import argparse
import csv
import functools
import importlib.resources
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import scipy.stats
from rliable import metrics

from cleanba_utils.errors import fail
from cleanba_utils.experiments import cli
from cleanba_utils.experiments.events import GRID_POINTS, read_scalars, running_mean
from cleanba_utils.experiments.figures import save_figure

TAGS = {"episodic_return": "charts/episodic_return", "eval": "eval/episodic_return"}
SCORE_COLUMNS = {"algorithm": str, "env_id": str, "seed": int, "score": float}
CURVE_COLUMNS = {
    "algorithm": str,
    "env_id": str,
    "seed": int,
    "global_step": int,
    "wall_time_s": float,
    "score": float,
}


@functools.cache
def reference_scores():
    """{env_id: (random score, human score)} for the 57 Atari games."""
    csv_file = importlib.resources.files("cleanba_utils.experiments") / "atari57_random_human.csv"
    text = csv_file.read_text()
    return {
        row["env_id"]: (float(row["random"]), float(row["human"]))
        for row in csv.DictReader(text.splitlines())
    }


def human_normalized(env_id, score):
    """Human-normalized score: 0 is a uniformly random agent, 1 is a human player."""
    if env_id not in reference_scores():
        raise ValueError(
            f"{env_id!r} is not one of the 57 Atari games (Alien-v5 ... Zaxxon-v5), "
            "so it has no human-normalized score; leave its runs out"
        )
    random, human = reference_scores()[env_id]
    return (score - random) / (human - random)


def iqm(scores):
    """Interquartile mean over the (runs, games) axes of `scores`, one value per trailing index."""
    return scipy.stats.trim_mean(
        scores.reshape(-1, *scores.shape[2:]), proportiontocut=0.25, axis=0
    )


# rliable's aggregate_iqm trims over every axis at once, but learning curves need one IQM per grid
# point, hence `iqm` above; rliable's median and mean already reduce only the (runs, games) axes.
AGGREGATES = {
    "median": metrics.aggregate_median,
    "iqm": iqm,
    "mean": metrics.aggregate_mean,
    "optimality_gap": metrics.aggregate_optimality_gap,
}
LABELS = {"median": "Median", "iqm": "IQM", "mean": "Mean", "optimality_gap": "Optimality gap"}


def all_metrics(scores):
    return np.array([statistic(scores) for statistic in AGGREGATES.values()])


def median_and_iqm(scores):
    return np.stack([AGGREGATES["median"](scores), AGGREGATES["iqm"](scores)])


def balance(per_game):
    """Stacks per-game arrays of seeds into a (runs, games, ...) array in which every game weighs
    the same: each game's seeds are repeated up to the least common multiple of the seed counts."""
    runs = math.lcm(*(len(seeds) for seeds in per_game))
    return np.stack([np.repeat(seeds, runs // len(seeds), axis=0) for seeds in per_game], axis=1)


# The bootstrap is ours, not rliable's: rliable 1.2's `library` module, which holds its bootstrap,
# does not import with the locked pandas (measured: TypeError from pandas' `deprecate_kwarg`), and a
# generator passed explicitly keeps the intervals reproducible from `--seed`. rliable gives the
# point metrics.
def bootstrap(per_game, reps, rng):
    """Stratified bootstrap samples: each game resamples its own seeds, so no game ever drops
    out."""
    for _ in range(reps):
        yield balance([seeds[rng.integers(len(seeds), size=len(seeds))] for seeds in per_game])


def estimate(per_game, statistic, reps, seed):
    """Point estimate and 95% bootstrap interval (lower, upper) of `statistic` of balanced
    scores."""
    samples = np.array(
        [statistic(sample) for sample in bootstrap(per_game, reps, np.random.default_rng(seed))]
    )
    return statistic(balance(per_game)), np.percentile(samples, [2.5, 97.5], axis=0)


def aggregate(by_algorithm, reps, seed):
    """{algorithm: {metric: (value, [lower, upper])}} from {algorithm: {env_id: HNS per seed}}."""
    results = {}
    for algorithm, games in by_algorithm.items():
        point, interval = estimate(list(games.values()), all_metrics, reps, seed)
        results[algorithm] = {name: (point[i], interval[:, i]) for i, name in enumerate(AGGREGATES)}
    return results


def run_identity(run_dir):
    """(exp_name, env_id, seed) from the spec.json a training script wrote into its run folder."""
    try:
        args = json.loads((run_dir / "spec.json").read_text())["args"]
        return args["exp_name"], args["env_id"], int(args["seed"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f"{run_dir / 'spec.json'} is not a training spec with args.exp_name, args.env_id and "
            "args.seed; fix it or move that run out of the runs folder"
        ) from None


def collect(runs_dir, metric, last_n, labels):
    """Score rows and learning-curve rows of every run folder under `runs_dir`."""
    if not runs_dir.is_dir():
        raise ValueError(
            f"{runs_dir} is not a folder; pass the folder the training scripts wrote runs to "
            "(--runs-dir)"
        )
    scores = []
    curves = []
    seen = {}
    for run_dir in sorted(spec.parent for spec in runs_dir.glob("*/spec.json")):
        exp_name, env_id, seed = run_identity(run_dir)
        key = (labels.get(exp_name, exp_name), env_id, seed)
        if key in seen:
            raise ValueError(
                f"{seen[key]} and {run_dir} are both {key[0]} on {env_id} with seed {seed}; "
                f"move one of them out of {runs_dir}"
            )
        seen[key] = run_dir
        run = dict(zip(("algorithm", "env_id", "seed"), key))
        logged = {name: read_scalars(run_dir, tag) for name, tag in TAGS.items()}
        logged = {name: scalars for name, scalars in logged.items() if len(scalars.steps)}
        if "episodic_return" in logged:
            train = logged["episodic_return"]
            for step, wall_time, score in zip(
                train.steps, train.wall_times, running_mean(train.values, last_n)
            ):
                curves.append(
                    {
                        **run,
                        "global_step": int(step),
                        "wall_time_s": float(wall_time),
                        "score": score,
                    }
                )
        if metric not in logged:
            cli.warn(f"skipping {run_dir}: it logged no {TAGS[metric]}", prog="hns")
            continue
        finals = (
            logged[metric].values[-last_n:]
            if metric == "episodic_return"
            else logged[metric].values
        )
        scores.append({**run, "score": float(np.mean(finals))})
    if not seen:
        raise ValueError(
            f"{runs_dir} has no run folders with a spec.json; point --runs-dir at the training runs"
        )
    if not scores:
        raise ValueError(
            f"no run folder under {runs_dir} logged {TAGS[metric]}; check --runs-dir and --metric"
        )
    in_order = lambda row: tuple(row.values())
    return sorted(scores, key=in_order), sorted(curves, key=in_order)


def write_csv(path, columns, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path, columns):
    """Rows of a CSV written by `collect`, each value converted to its column's type."""
    if not path.is_file():
        raise ValueError(
            f"{path} does not exist; write it with `python -m cleanba_utils.experiments.hns "
            "collect`"
        )
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [column for column in columns if column not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"{path} lacks the column(s) {', '.join(missing)}; "
                f"expected {','.join(columns)} as written by "
                "`python -m cleanba_utils.experiments.hns collect`"
            )
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                rows.append({column: kind(row[column]) for column, kind in columns.items()})
            except (TypeError, ValueError):
                raise ValueError(
                    f"{path} line {line} has a missing or malformed value; "
                    f"expected {','.join(columns)}"
                ) from None
    if not rows:
        raise ValueError(f"{path} has no rows; collect some finished runs first")
    return rows


def scores_by_game(rows):
    """{algorithm: {env_id: HNS per seed}} from score rows, sorted by name."""
    grouped = {}
    for row in rows:
        grouped.setdefault(row["algorithm"], {}).setdefault(row["env_id"], []).append(
            human_normalized(row["env_id"], row["score"])
        )
    return {
        alg: {env: np.array(games[env]) for env in sorted(games)}
        for alg, games in sorted(grouped.items())
    }


def curves_by_run(rows):
    """{(algorithm, env_id, seed): {column: array}} from learning-curve rows."""
    grouped = {}
    for row in rows:
        grouped.setdefault((row["algorithm"], row["env_id"], row["seed"]), []).append(row)
    columns = ("global_step", "wall_time_s", "score")
    return {
        key: {c: np.array([r[c] for r in run]) for c in columns}
        for key, run in sorted(grouped.items())
    }


def on_common_grid(curves, x):
    """A grid over the `x` range that every curve reaches, so no curve is extrapolated, and each
    curve's score interpolated onto it: (grid, (curves, grid points) array)."""
    low = max(curve[x].min() for curve in curves)
    grid = np.linspace(low, max(low, min(curve[x].max() for curve in curves)), GRID_POINTS)
    orders = [np.argsort(curve[x], kind="stable") for curve in curves]
    return grid, np.stack(
        [np.interp(grid, c[x][order], c["score"][order]) for c, order in zip(curves, orders)]
    )


def hns_curves(runs, x, reps, seed):
    """{algorithm: (grid, median and IQM HNS (2, points), their intervals (2, 2, points))} along
    `x`."""
    results = {}
    for algorithm in sorted({key[0] for key in runs}):
        keys = [key for key in runs if key[0] == algorithm]
        grid, scores = on_common_grid([runs[key] for key in keys], x)
        per_game = {}
        for (_, env_id, _), score in zip(keys, scores):
            per_game.setdefault(env_id, []).append(human_normalized(env_id, score))
        results[algorithm] = (
            grid,
            *estimate([np.array(s) for s in per_game.values()], median_and_iqm, reps, seed),
        )
    return results


def plot_hns_curves(curves, xlabel, scale, colors, path):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for algorithm, (grid, point, interval) in curves.items():
        for i, ax in enumerate(axes):
            ax.plot(grid / scale, point[i], color=colors[algorithm], label=algorithm)
            ax.fill_between(
                grid / scale, interval[0, i], interval[1, i], color=colors[algorithm], alpha=0.2
            )
    for ax, name in zip(axes, ("Median", "IQM")):
        ax.set(title=f"{name} HNS", xlabel=xlabel, ylabel=f"{name} human-normalized score")
        ax.legend()
    fig.suptitle(f"Human-normalized score vs {xlabel}, 95% stratified bootstrap CIs")
    save_figure(fig, path)


def plot_intervals(results, colors, path):
    fig, axes = plt.subplots(
        1,
        len(AGGREGATES),
        figsize=(14, 1.8 + 0.5 * len(results)),
        sharey=True,
        layout="constrained",
    )
    for ax, name in zip(axes, AGGREGATES):
        for y, (algorithm, estimates) in enumerate(results.items()):
            value, (lower, upper) = estimates[name]
            ax.barh(
                y,
                upper - lower,
                left=lower,
                height=0.6,
                color=colors[algorithm],
                alpha=0.7,
                label=algorithm,
            )
            ax.vlines(value, y - 0.3, y + 0.3, color="black")
        ax.set(title=LABELS[name], xlabel="human-normalized score")
    axes[0].set_yticks(range(len(results)), list(results))
    axes[0].set_ylabel("algorithm")
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=len(results))
    fig.suptitle(
        "Aggregate HNS: 95% stratified bootstrap CIs (bars) and point estimates (black lines)"
    )
    save_figure(fig, path)


def plot_profile(by_algorithm, reps, seed, colors, path):
    every_score = np.concatenate([s for games in by_algorithm.values() for s in games.values()])
    taus = np.linspace(min(0.0, every_score.min()), max(1.0, every_score.max()), GRID_POINTS)

    def fraction_above(scores):
        return (scores[..., None] > taus).mean(axis=(0, 1))

    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for algorithm, games in by_algorithm.items():
        profile, interval = estimate(list(games.values()), fraction_above, reps, seed)
        ax.plot(taus, profile, color=colors[algorithm], label=algorithm)
        ax.fill_between(taus, interval[0], interval[1], color=colors[algorithm], alpha=0.2)
    ax.axvline(1.0, color="gray", linestyle=":", label="human level")
    ax.set(
        title="Performance profile, 95% stratified bootstrap CIs",
        xlabel=r"human-normalized score $\tau$",
    )
    ax.set_ylabel(r"fraction of runs with HNS $> \tau$")
    ax.legend()
    save_figure(fig, path)


def plot_per_game(runs, colors, path):
    games = sorted({key[1] for key in runs})
    cols = math.ceil(math.sqrt(len(games)))
    rows = math.ceil(len(games) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols + 2, 2.6 * rows + 1), squeeze=False, layout="constrained"
    )
    for ax, game in zip(axes.flat, games):
        for algorithm in sorted({key[0] for key in runs if key[1] == game}):
            seeds = [curve for key, curve in runs.items() if key[:2] == (algorithm, game)]
            grid, scores = on_common_grid(seeds, "global_step")
            ax.plot(grid, scores.mean(axis=0), color=colors[algorithm], label=algorithm)
            ax.fill_between(
                grid, scores.min(axis=0), scores.max(axis=0), color=colors[algorithm], alpha=0.2
            )
        ax.set_title(game)
    for ax in axes.flat[len(games) :]:
        ax.axis("off")
    legend = {
        label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())
    }
    fig.legend(legend.values(), legend.keys(), loc="outside right center")
    fig.supxlabel("environment steps")
    fig.supylabel("episodic return (running mean)")
    fig.suptitle(
        "Per-game learning curves: mean over seeds, shaded from min to max seed", fontsize="x-large"
    )
    save_figure(fig, path)


def warn_if_games_differ(by_algorithm):
    if len({tuple(games) for games in by_algorithm.values()}) > 1:
        cli.warn(
            "the algorithms were run on different sets of games, so their aggregates are not "
            "directly comparable",
            prog="hns",
        )


def format_table(results, by_algorithm, reps):
    header = ["algorithm", "games", "runs", *LABELS.values()]
    rows = [
        [
            algorithm,
            str(len(by_algorithm[algorithm])),
            str(sum(len(seeds) for seeds in by_algorithm[algorithm].values())),
            *(
                f"{value:.3f} [{lower:.3f}, {upper:.3f}]"
                for value, (lower, upper) in estimates.values()
            ),
        ]
        for algorithm, estimates in results.items()
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(
        [*lines, f"human-normalized scores, 95% stratified bootstrap CIs from {reps} resamples"]
    )


def run_collect(args):
    scores, curves = collect(args.runs_dir, args.metric, args.last_n, dict(args.label))
    write_csv(args.scores_out, SCORE_COLUMNS, scores)
    write_csv(args.curves_out, CURVE_COLUMNS, curves)
    print(
        f"wrote {len(scores)} run scores to {args.scores_out} and {len(curves)} curve points to "
        f"{args.curves_out}"
    )


def run_aggregate(args):
    by_algorithm = scores_by_game(read_csv(args.scores, SCORE_COLUMNS))
    warn_if_games_differ(by_algorithm)
    results = aggregate(by_algorithm, args.reps, args.seed)
    if args.json:
        as_json = {
            algorithm: {
                name: {"value": float(v), "ci": interval.tolist()}
                for name, (v, interval) in estimates.items()
            }
            for algorithm, estimates in results.items()
        }
        print(json.dumps(as_json, indent=2))
    else:
        print(format_table(results, by_algorithm, args.reps))


def run_plot(args):
    by_algorithm = scores_by_game(read_csv(args.scores, SCORE_COLUMNS))
    runs = curves_by_run(read_csv(args.curves, CURVE_COLUMNS))
    warn_if_games_differ(by_algorithm)
    colors = {
        algorithm: f"C{i}"
        for i, algorithm in enumerate(sorted(set(by_algorithm) | {key[0] for key in runs}))
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    names = (
        "hns_vs_steps",
        "hns_vs_wall_time",
        "aggregate_intervals",
        "performance_profile",
        "per_game_curves",
    )
    paths = {name: args.out_dir / f"{name}.png" for name in names}
    plot_hns_curves(
        curves=hns_curves(runs, "global_step", args.reps, args.seed),
        xlabel="environment steps",
        scale=1,
        colors=colors,
        path=paths["hns_vs_steps"],
    )
    plot_hns_curves(
        curves=hns_curves(runs, "wall_time_s", args.reps, args.seed),
        xlabel="wall-clock hours",
        scale=3600,
        colors=colors,
        path=paths["hns_vs_wall_time"],
    )
    plot_intervals(
        aggregate(by_algorithm, args.reps, args.seed), colors, paths["aggregate_intervals"]
    )
    plot_profile(
        by_algorithm=by_algorithm,
        reps=args.reps,
        seed=args.seed,
        colors=colors,
        path=paths["performance_profile"],
    )
    plot_per_game(runs, colors, paths["per_game_curves"])
    print("wrote " + ", ".join(str(path) for path in paths.values()))


def label_pair(text):
    exp_name, _, label = text.partition("=")
    if not (exp_name and label):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not EXP_NAME=LABEL, e.g. --label cleanba_ppo=PPO"
        )
    return exp_name, label


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cleanba_utils.experiments.hns", description="Human-normalized Atari scores."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    summaries = {
        "collect": "read run folders into a scores CSV and a learning-curves CSV",
        "aggregate": "median, IQM, mean and optimality gap of HNS with stratified bootstrap CIs",
        "plot": "HNS curves, aggregate intervals, performance profile and per-game curves as PNGs",
    }
    collect_parser, aggregate_parser, plot_parser = (
        commands.add_parser(name, help=summary, description=summary)
        for name, summary in summaries.items()
    )
    collect_parser.add_argument(
        "--runs-dir",
        type=Path,
        default=Path("runs"),
        help="folder with one run folder (spec.json + events) per run",
    )
    collect_parser.add_argument(
        "--scores-out",
        type=Path,
        default=Path("scores.csv"),
        help="CSV of algorithm,env_id,seed,score",
    )
    collect_parser.add_argument(
        "--curves-out",
        type=Path,
        default=Path("curves.csv"),
        help="CSV of algorithm,env_id,seed,global_step,wall_time_s,score",
    )
    collect_parser.add_argument(
        "--metric",
        choices=list(TAGS),
        default="episodic_return",
        help="score a run by the mean of its last --last-n training episodes, or of its "
        "evaluation episodes",
    )
    collect_parser.add_argument(
        "--last-n",
        type=cli.positive_int,
        default=100,
        help="episodes averaged into a score or curve point",
    )
    collect_parser.add_argument(
        "--label",
        type=label_pair,
        action="append",
        default=[],
        metavar="EXP_NAME=LABEL",
        help="name the algorithm of runs with this exp_name LABEL (repeatable)",
    )
    for command_parser in (aggregate_parser, plot_parser):
        command_parser.add_argument(
            "--scores", type=Path, required=True, help="scores CSV written by collect"
        )
        command_parser.add_argument(
            "--reps", type=cli.positive_int, default=2000, help="bootstrap resamples"
        )
        command_parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    aggregate_parser.add_argument(
        "--json", action="store_true", help="print {algorithm: {metric: {value, ci}}}"
    )
    plot_parser.add_argument(
        "--curves", type=Path, required=True, help="curves CSV written by collect"
    )
    plot_parser.add_argument(
        "--out-dir", type=Path, default=Path("plots"), help="folder for the PNGs"
    )
    for command_parser in (parser, collect_parser, aggregate_parser, plot_parser):
        cli.one_line_errors(command_parser, "hns")
    args = parser.parse_args(argv)
    try:
        {"collect": run_collect, "aggregate": run_aggregate, "plot": run_plot}[args.command](args)
    except ValueError as error:
        fail(str(error), prog="hns")


if __name__ == "__main__":
    main()
