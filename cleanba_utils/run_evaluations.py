"""A run's evaluations (--eval-episodes, --eval-every): when they are due, the one of the untrained
policy, each logged and kept in the run folder, the episodes filmed with --capture-video."""

import dataclasses
import json
import os
import time

import jax
import numpy as np

from cleanba_utils import gymnasium_envs
from cleanba_utils.run_logs import RunLogs
from cleanba_utils.stops import Stops

# (global step, mean return) of every evaluation so far, in the run folder.
EVALUATIONS_FILE = "evaluations.json"
EVAL_SEED_OFFSET = 1_000_000
"""Evaluation environments are seeded with the run's seed + this: never the training ones."""


@dataclasses.dataclass
class RunEvaluations:
    """The evaluations of one run, made in the process that logs."""

    args: object
    sizes: object
    dir: str
    evaluate: object
    """the script's `evaluate(params, args, num_episodes, seed)`: the returns of `num_episodes`
    episodes of the policy `params` (what `evaluate_and_log` and the end of the run play)"""
    logs: RunLogs
    stops: Stops
    made: list = dataclasses.field(default_factory=list)
    """(global step, mean return) of the run's evaluations, those made before a resume included"""
    last_evaluation: tuple | None = None
    """(update, returns of its episodes) of this process's newest evaluation"""
    untrained_evaluation_s: float = 0.0
    """seconds of the evaluation at step 0 (`evaluate_untrained`), which the estimate of the run's
    duration after its first update leaves out"""

    def evaluation_due(self, update: int) -> bool:
        """With --eval-episodes: every --eval-every updates, and after the last one. The same answer
        in every process (a script whose parameters need a collective gathers them in all)."""
        args = self.args
        every = args.eval_every
        due = update == self.sizes.num_updates or (every > 0 and update % every == 0)
        return args.eval_episodes > 0 and due

    def evaluate_untrained(self, policy):
        """SLM Lab's first checkpoint: with --eval-every, a run that starts from scratch evaluates
        its untrained policy before the first update, at global step 0 and optimizer steps 0, as
        `evaluate_and_log` (a resumed run made that evaluation before its checkpoint). `policy()`
        gives what the script's `evaluate` plays, the expression of its evaluations after an
        update; it is called in every process, as those are."""
        args = self.args
        if self.logs.first_update or not (args.eval_every > 0 and args.eval_episodes > 0):
            return
        started = time.time()
        self.evaluate_and_log(0, policy(), 0)
        self.untrained_evaluation_s = time.time() - started

    def evaluate_and_log(self, update: int, params, optimizer_steps: int):
        """Plays --eval-episodes episodes of `params` with the script's `evaluate`, in environments
        of the evaluation seed (the run's + 1,000,000), in the process that logs. Their mean return
        is logged as charts/eval_return and the learner's optimizer steps so far as charts/opt_step,
        both at the update's global step, and kept for summary.json (in the run folder too: a
        resumed run's summary lists the evaluations made before its checkpoint). With
        --capture-video the first episode is filmed (`gymnasium_envs.filming`): an mp4 in the run
        folder and videos/eval in TensorBoard."""
        if jax.process_index() != 0:
            return
        args = self.args
        global_step = update * self.sizes.steps_per_update
        film = None
        if args.capture_video:
            path = os.path.join(self.dir, "videos", f"eval_{global_step:012d}.mp4")
            film = gymnasium_envs.Film(path)
        with gymnasium_envs.filming(film):
            returns = self.evaluate(params, args, args.eval_episodes, args.seed + EVAL_SEED_OFFSET)
        if film is not None and film.frames is not None:
            # (batch, time, channels, height, width), as tensorboardX takes a video.
            video = np.transpose(film.frames[None], (0, 1, 4, 2, 3))
            self.logs.writer.add_video("videos/eval", video, global_step, fps=film.fps)
        mean_return = float(np.mean(returns))
        self.logs.log(
            {"charts/eval_return": mean_return, "charts/opt_step": optimizer_steps}, global_step
        )
        print(f"eval: mean return {mean_return:.1f} at step {global_step}", flush=True)
        self.made.append([global_step, mean_return])
        self.last_evaluation = (update, returns)
        self.stops.write_json(EVALUATIONS_FILE, self.made)


def kept_evaluations(run_dir: str, purge_step: int | None) -> list:
    """The evaluations in the run folder before `purge_step` (a resumed run's first step after its
    checkpoint; None: a run from scratch, none kept). Like TensorBoard's, what the preempted run
    evaluated after its checkpoint is made again."""
    path = os.path.join(run_dir, EVALUATIONS_FILE)
    if purge_step is None or not os.path.exists(path):
        return []
    with open(path) as f:
        return [evaluation for evaluation in json.load(f) if evaluation[0] < purge_step]
