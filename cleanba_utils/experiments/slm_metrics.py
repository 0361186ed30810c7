"""SLM Lab's eight metrics of a trial, with SLM Lab's names and its formulas (SLM Lab v4.1.1, its
experiment analysis), computed from each session's evaluation series.

A session is one run (one seed); its series has, at each evaluation i (a checkpoint),
`frame` t_i (environment steps summed over the vectorized environments: the global step),
`opt_step` o_i (optimizer steps of the learner so far) and `total_reward` R_i (the mean return of
the evaluation's episodes). With R_rand the mean return of a uniformly random policy on the task
(random_baseline.py) and str_i = R_i - R_rand, the local strength at checkpoint i:

| metric              | per session                                                          |
|---------------------|----------------------------------------------------------------------|
| final_return_ma     | mean of the last min(100, N) R_i                                     |
| strength            | (1/N) sum_i str_i                                                    |
| max_strength        | max_i str_i                                                          |
| final_strength      | str_N (the last checkpoint)                                          |
| sample_efficiency   | sum_i (str_i / t_i) / sum_i str_i, terms with t_i = 0 left out       |
| training_efficiency | sum_i (str_i / o_i) / sum_i str_i, terms with o_i = 0 left out       |
| stability           | 1 - abs(sum_{i<N} min(str_{i+1} - str_i, 0) / sum_{i<N} str_i)       |

A trial's value of each of these is their mean over its sessions (a session's NaN left out, NaN if
every session's is), and its eighth metric is

    consistency = 1 - sum_i 2 std_j(str_ij) / sum_i mean_j(str_ij)

over checkpoints i and sessions j (std: the sample standard deviation, n - 1 in its denominator).

The efficiencies are as SLM Lab's code computes them; its docstring's formula (a mean of str_i
weighted by 1/t_i) is another quantity. Where a formula divides by a sum of zero, SLM Lab's
division gives +-inf or NaN; these functions return NaN, which says "no value" in a ranking and in
JSON alike. Each function's docstring says what it returns in the other edge cases.
"""

from typing import NamedTuple

import numpy as np

MA_WINDOW = 100  # evaluations averaged by final_return_ma (SLM Lab's moving-average window)
SESSION_COLUMNS = ("frame", "opt_step", "total_reward")
SESSION_METRICS = (
    "final_return_ma",
    "strength",
    "max_strength",
    "final_strength",
    "sample_efficiency",
    "training_efficiency",
    "stability",
)
TRIAL_METRICS = (*SESSION_METRICS, "consistency")


class SessionSeries(NamedTuple):
    """One session's evaluations in step order."""

    frame: np.ndarray  # environment steps at each evaluation (int)
    opt_step: np.ndarray  # optimizer steps at each evaluation (float: NaN where not logged)
    total_reward: np.ndarray  # mean return of each evaluation's episodes


def local_strengths(total_reward, random_return: float) -> np.ndarray:
    """str_i = R_i - R_rand at every checkpoint."""
    return np.asarray(total_reward, np.float64) - random_return


def final_return_ma(total_reward) -> float:
    """The mean of the last MA_WINDOW returns (all of them when there are fewer)."""
    return float(np.mean(np.asarray(total_reward, np.float64)[-MA_WINDOW:]))


def efficiency(strengths, times) -> float:
    """sum_i (str_i / t_i) / sum_i str_i. A term whose ratio is not finite (t_i = 0, as at a
    checkpoint before any step) is left out of the numerator and stays in the denominator, as SLM
    Lab leaves it. NaN if the strengths sum to zero, or if a t_i is NaN (not logged: the ratio
    would be unknown, not absent)."""
    strengths = np.asarray(strengths, np.float64)
    times = np.asarray(times, np.float64)
    total = strengths.sum()
    if np.isnan(times).any() or total == 0:
        return float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = strengths / times
    return float(ratios[np.isfinite(ratios)].sum() / total)


def stability(strengths) -> float:
    """1 - |sum of the drops between consecutive checkpoints / sum of the strengths before them|:
    the share of the strength lost in drops. 1: it never drops. NaN with one checkpoint (no pair)
    or when str_0 .. str_{N-1} sum to zero."""
    strengths = np.asarray(strengths, np.float64)
    drops = np.minimum(np.diff(strengths), 0.0)
    before = strengths[:-1].sum()
    if len(strengths) < 2 or before == 0:
        return float("nan")
    return float(1 - abs(drops.sum() / before))


def consistency(strengths_per_session) -> float:
    """1 - sum_i 2 std_j(str_ij) / sum_i mean_j(str_ij). Checkpoint i of every session is matched
    by position (the sessions of a trial evaluate at the same steps); a session with fewer
    checkpoints is left out where it has none. A checkpoint that only one session reached has no
    standard deviation and adds nothing to the numerator, its mean still adds to the denominator
    (as in SLM Lab). NaN with a single session: there is no spread to measure (SLM Lab's code
    reports 1.0 there, its sum of the missing deviations being 0); NaN when the means sum to
    zero."""
    longest = max(len(s) for s in strengths_per_session)
    table = np.full((len(strengths_per_session), longest), np.nan)
    for row, strengths in zip(table, strengths_per_session):
        row[: len(strengths)] = strengths
    present = (~np.isnan(table)).sum(axis=0)
    means = np.nanmean(table, axis=0)
    spread = present >= 2
    if not spread.any() or means.sum() == 0:
        return float("nan")
    stds = np.nanstd(table[:, spread], axis=0, ddof=1)
    return float(1 - 2 * stds.sum() / means.sum())


def session_metrics(series: SessionSeries, random_return: float) -> dict:
    """The seven session metrics of SESSION_METRICS (the order of SLM Lab's table)."""
    strengths = local_strengths(series.total_reward, random_return)
    return {
        "final_return_ma": final_return_ma(series.total_reward),
        "strength": float(strengths.mean()),
        "max_strength": float(strengths.max()),
        "final_strength": float(strengths[-1]),
        "sample_efficiency": efficiency(strengths, series.frame),
        "training_efficiency": efficiency(strengths, series.opt_step),
        "stability": stability(strengths),
    }


def trial_metrics(all_series: list[SessionSeries], random_return: float) -> dict:
    """The eight trial metrics of TRIAL_METRICS: each session metric's mean over the sessions
    whose value is not NaN (NaN if none has one), and consistency."""
    per_session = [session_metrics(series, random_return) for series in all_series]
    means = {}
    for name in SESSION_METRICS:
        values = np.array([metrics[name] for metrics in per_session])
        known = values[~np.isnan(values)]
        means[name] = float(known.mean()) if len(known) else float("nan")
    strengths = [local_strengths(s.total_reward, random_return) for s in all_series]
    return {**means, "consistency": consistency(strengths)}
