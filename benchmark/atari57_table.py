"""The per-game table of an Atari-57 experiment run by `benchmark/atari57.sh ALGORITHM VARIANT cpu`.

One row per game: the return of its evaluation episode (what `hns collect --metric eval` scored),
its HNS, the mean of the last training episodes where any ended, the random and human scores, and
the run's steps, SPS and wall time.

    python benchmark/atari57_table.py impala_cpu --csv benchmark/results/atari57_cpu.csv

Prints the table as Markdown and writes the CSV (one row per run, the columns of csv_columns.py
first). A game that ended no training episode within its budget has no final training return.
"""

import argparse
import csv
import json
from pathlib import Path

from csv_columns import RUN_COLUMNS

from cleanba_utils.experiments.hns import (
    CURVE_COLUMNS,
    SCORE_COLUMNS,
    human_normalized,
    read_csv,
    reference_scores,
)

COLUMNS = [*RUN_COLUMNS, "episodes", "random", "human", "hns"]


def rows_of(experiment: str, runs_dir: Path) -> list[dict]:
    """One row per game of the experiment, in the order of the reference scores."""
    hns_dir = runs_dir / "_hns" / experiment
    scores = {row["env_id"]: row for row in read_csv(hns_dir / "scores.csv", SCORE_COLUMNS)}
    curves = read_csv(hns_dir / "curves.csv", CURVE_COLUMNS)
    rows = []
    for env_id, (random, human) in reference_scores().items():
        run_dir = runs_dir / f"{env_id}__{experiment}__0__1"
        spec = json.loads((run_dir / "spec.json").read_text())
        summary = json.loads((run_dir / "summary.json").read_text())
        score = scores.get(env_id)
        training = [curve["score"] for curve in curves if curve["env_id"] == env_id]
        rows.append(
            dict(
                script=Path(spec["script"]).name,
                mode=experiment,
                env_id=env_id,
                seed=spec["args"]["seed"],
                steps=summary["global_step"],
                final_return=round(training[-1], 2) if training else None,
                eval_return=round(score["score"], 2) if score else None,
                sps=summary["sps"],
                wall_time_s=round(summary["wall_time_s"], 1),
                episodes=sum(curve["env_id"] == env_id for curve in curves),
                random=random,
                human=human,
                hns=round(human_normalized(env_id, score["score"]), 4) if score else None,
            )
        )
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| game | evaluation return | HNS | training return (episodes) | random | human | steps "
        "| SPS | wall time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        final = "no episode ended" if row["final_return"] is None else f"{row['final_return']:.1f}"
        evaluation = "none" if row["eval_return"] is None else f"{row['eval_return']:.1f}"
        hns = "" if row["hns"] is None else f"{row['hns']:.4f}"
        lines.append(
            f"| {row['env_id']} | {evaluation} | {hns} | {final} ({row['episodes']}) "
            f"| {row['random']:g} | {row['human']:g} | {row['steps']} | {row['sps']} "
            f"| {row['wall_time_s']} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", help="the experiment name, e.g. impala_cpu")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"))
    parser.add_argument("--csv", type=Path, required=True, help="where to write the CSV")
    args = parser.parse_args()
    rows = rows_of(args.experiment, args.runs_dir)
    with args.csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(markdown(rows))


if __name__ == "__main__":
    main()
