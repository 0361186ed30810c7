"""One training run's plumbing, shared by every script, opened in one call (`open_run`): its folder
and spec, its logs and console (`run_logs`), its stops and checkpoints (`stops`), its evaluations
(`run_evaluations`) and its end (the model, summary.json, the upload). The script keeps its
algorithm, its actors and its learner loop; `Run` holds what the loop needs besides."""

import dataclasses
import os
import sys
import time

import jax
import numpy as np
from tensorboardX import SummaryWriter

from cleanba_utils import accelerators, hub, run_files, signals
from cleanba_utils.checkpoints import FIRST_REPLICA, Checkpointing
from cleanba_utils.env_ids import name_part
from cleanba_utils.errors import fail
from cleanba_utils.run_evaluations import EVAL_SEED_OFFSET, RunEvaluations, kept_evaluations
from cleanba_utils.run_logs import PROGRESS_SECONDS, RunLogs
from cleanba_utils.stops import Stops, end_at_once


@dataclasses.dataclass
class Run:
    """A run's pieces (`logs`: what the loop logs and prints; `stops`; `evaluations`), and the
    calls of a script's learner loop on them."""

    args: object
    sizes: object
    script_path: str
    name: str
    dir: str
    logs: RunLogs
    stops: Stops
    evaluations: RunEvaluations
    model_card: object = None
    """the script's `hub.ModelCard` for --upload-model (None: its file name, no paper)"""

    @property
    def stop(self):
        """set when the run ends or any thread fails: every queue wait gives up"""
        return self.stops.stop

    @property
    def failures(self) -> list:
        return self.stops.failures

    @property
    def received_signals(self) -> list:
        return self.stops.received_signals

    @property
    def is_main(self) -> bool:
        return jax.process_index() == 0

    def evaluation_due(self, update: int) -> bool:
        return self.evaluations.evaluation_due(update)

    def evaluate_untrained(self, policy):
        self.evaluations.evaluate_untrained(policy)

    def evaluate_and_log(self, update: int, params, optimizer_steps: int):
        self.evaluations.evaluate_and_log(update, params, optimizer_steps)

    def after_update(self, state, update: int) -> int:
        """Called with what a checkpoint of `update` saves as soon as the update is dispatched:
        `stops.Stops.after_update`, which returns the exit code of a stop (else 0)."""
        return self.stops.after_update(state, update, self.evaluations.untrained_evaluation_s)

    def learner_loop(self, threads: list):
        """`stops.Stops.learner_loop`: wraps the learner's loop."""
        return self.stops.learner_loop(threads)

    def finish(self, params, update: int, optimizer_steps: int):
        """After the last update: the model file, the final evaluation's episodes (the one the loop
        made after its last update, else one made here), summary.json, the upload of
        --upload-model and the fingerprint as the last line of stdout; stop signals are ignored
        from then on. A model that could not be uploaded ends the process with one line and exit
        code hub.UPLOAD_FAILED_EXIT_CODE, every file of the run written."""
        self.stops.training_done = True
        self.logs.end_progress()
        wall_time_s = self.stops.wall_time()
        fingerprint = run_files.params_fingerprint(params)
        model_path = self.save_model(params)
        eval_returns = self.final_evaluation(params, update, optimizer_steps)
        self.write_summary(fingerprint, update, wall_time_s)
        upload_failure = None
        if self.args.upload_model and self.is_main:
            upload_failure = self.upload(
                params,
                update=update,
                fingerprint=fingerprint,
                model_path=model_path,
                eval_returns=eval_returns,
            )
        self.logs.close()
        self.stops.end_if_events_failed()
        if self.args.track and self.is_main:
            import wandb

            try:
                wandb.finish()
            except Exception as error:
                # The run's own files hold its results: W&B's failure (a full disk) is one line.
                print(f"warning: W&B could not finish the run: {error}", file=sys.stderr)
        print(f"params_fingerprint={fingerprint}", flush=True)
        signals.ignore_stop_signals()
        if upload_failure is not None:
            print(upload_failure, file=sys.stderr, flush=True)
            sys.exit(hub.UPLOAD_FAILED_EXIT_CODE)

    def save_model(self, params) -> str | None:
        """With --save-model, the model file (process 0's); its path."""
        if not (self.args.save_model and self.is_main):
            return None
        try:
            model_path = run_files.save_model(self.args, params, self.dir, self.script_path)
        except OSError as error:
            self.stops.write_failed("model file", error.filename, error)
        print(f"model saved to {model_path}")
        return model_path

    def final_evaluation(self, params, update: int, optimizer_steps: int) -> list | None:
        """With --eval-episodes, the returns of the evaluation after the last update (made here if
        the loop has not), each logged as eval/episodic_return; process 0's."""
        if not (self.args.eval_episodes and self.is_main):
            return None
        final = self.evaluations.last_evaluation
        if final is None or final[0] != update:
            self.evaluations.evaluate_and_log(update, params, optimizer_steps)
        eval_returns = self.evaluations.last_evaluation[1]
        for episode, episode_return in enumerate(eval_returns):
            self.logs.writer.add_scalar("eval/episodic_return", episode_return, episode)
        print(f"eval: mean return {np.mean(eval_returns):.1f} over {len(eval_returns)} episodes")
        return eval_returns

    def write_summary(self, fingerprint: str, update: int, wall_time_s: float):
        """summary.json: the fingerprint, steps, speed up to the end of training (`wall_time_s`)
        and the evaluations (process 0's)."""
        if not self.is_main:
            return
        global_step = update * self.sizes.steps_per_update
        summary = dict(
            params_fingerprint=fingerprint,
            global_step=global_step,
            learner_policy_version=update,
            sps=int(global_step / wall_time_s),
            wall_time_s=wall_time_s,
        )
        evaluations = self.evaluations.made
        if evaluations:
            summary["eval_return"] = evaluations[-1][1]
            summary["eval_returns"] = evaluations
        self.stops.write_json("summary.json", summary)

    def upload(self, params, update, fingerprint, model_path, eval_returns) -> str | None:
        """--upload-model: the model and its card on the Hugging Face Hub; the line of a failure."""
        args = self.args
        return hub.upload_run(
            args,
            self.dir,
            self.script_path,
            model_path,
            card=self.model_card,
            eval_returns=eval_returns,
            play=lambda episodes: self.evaluations.evaluate(
                params, args, episodes, args.seed + EVAL_SEED_OFFSET
            ),
            eval_seed=args.seed + EVAL_SEED_OFFSET,
            training_returns=list(self.logs.recent_returns),
            global_step=update * self.sizes.steps_per_update,
            params_fingerprint=fingerprint,
        )


def open_run(
    args,
    sizes,
    script_path: str,
    counters: dict,
    global_learner_devices: list,
    *,
    evaluate,
    model_card=None,
    checkpointing: Checkpointing = FIRST_REPLICA,
) -> Run:
    """The run folder, its spec and its TensorBoard writer (and W&B with --track); process 0 alone
    writes. What the run needs of the script is given here, once: its `evaluate`, the
    `hub.ModelCard` of its --upload-model, and how its checkpoints are made
    (`checkpoints.Checkpointing`).
    `counters["update"] > 0` means a resumed run: it writes `spec_resume_<update>.json`, and
    TensorBoard drops what the preempted run logged after its checkpoint (purge_step), so the curves
    read as one stream."""
    backend = jax.default_backend()
    accelerators.check_opt_out(args, backend)
    name = (
        args.run_name
        or f"{name_part(args.env_id)}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )
    run_dir = os.path.join("runs", name)
    resumed_update = counters["update"]
    is_main = jax.process_index() == 0
    if resumed_update:
        print(f"resuming {name} from update {resumed_update}")
    if is_main:
        write_spec(
            args,
            sizes,
            name=name,
            script_path=script_path,
            run_dir=run_dir,
            resumed_update=resumed_update,
        )
    if args.upload_model and is_main:
        hub.note_missing_token()
    if args.track and is_main:
        start_wandb(args, name)
    purge_step = resumed_update * sizes.steps_per_update + 1 if resumed_update else None
    logs = RunLogs(
        args=args,
        sizes=sizes,
        writer=open_writer(args, run_dir, purge_step, is_main),
        first_update=resumed_update,
    )
    num_local = sum(
        device.process_index == jax.process_index() for device in global_learner_devices
    )
    stops = Stops(
        args=args,
        sizes=sizes,
        dir=run_dir,
        counters=counters,
        logs=logs,
        stop_agreed=signals.stop_agreement(global_learner_devices, num_local, args.distributed),
        checkpointing=checkpointing,
    )
    evaluations = RunEvaluations(
        args=args,
        sizes=sizes,
        dir=run_dir,
        evaluate=evaluate,
        logs=logs,
        stops=stops,
        made=kept_evaluations(run_dir, purge_step),
    )
    run = Run(
        args=args,
        sizes=sizes,
        script_path=script_path,
        name=name,
        dir=run_dir,
        logs=logs,
        stops=stops,
        evaluations=evaluations,
        model_card=model_card,
    )
    if is_main:
        line = opening_line(
            args,
            sizes,
            name=name,
            num_learner_devices=len(global_learner_devices),
            backend=backend,
        )
        print(line, flush=True)
        logs.start_progress(stops.end_if_events_failed)
    return run


def write_spec(args, sizes, name: str, script_path: str, run_dir: str, resumed_update: int):
    """spec.json, or a resumed run's spec_resume_<update>.json: what `run_files.run_description`
    says of the run."""
    spec_path = os.path.join(
        run_dir, f"spec_resume_{resumed_update}.json" if resumed_update else "spec.json"
    )
    try:
        os.makedirs(run_dir, exist_ok=True)
        run_files.write_json_atomically(
            spec_path, run_files.run_description(args, sizes, name, script_path)
        )
    except OSError as error:
        end_at_once(run_files.write_failure("run file", error.filename, error))


def start_wandb(args, name: str):
    """--track: the run in Weights & Biases, its TensorBoard scalars synced (resumed by its name
    with --resume); one line and exit 2 if it cannot start."""
    import wandb

    try:
        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            sync_tensorboard=True,
            config=dataclasses.asdict(args),
            name=name,
            group=args.group or None,
            save_code=True,
            id=name if args.resume else None,
            resume="allow" if args.resume else None,
        )
    except wandb.errors.Error as error:
        fail(
            f"--track could not start Weights & Biases ({str(error).splitlines()[0]}); log in "
            "with `wandb login`, or set WANDB_MODE=offline to log here and `wandb sync` later"
        )


def open_writer(args, run_dir: str, purge_step: int | None, is_main: bool) -> SummaryWriter:
    """The run's TensorBoard writer (writing to disk in process 0 alone), its hyperparameters
    written as a table."""
    # Flushed every few seconds (tensorboardX's default is 2 minutes): a search's pruner reads the
    # events while the run goes on.
    try:
        writer = SummaryWriter(run_dir, write_to_disk=is_main, purge_step=purge_step, flush_secs=5)
    except OSError as error:
        end_at_once(run_files.write_failure("TensorBoard events in", run_dir, error))
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n"
        + "\n".join(f"|{k}|{v}|" for k, v in dataclasses.asdict(args).items()),
    )
    return writer


def opening_line(args, sizes, name: str, num_learner_devices: int, backend: str) -> str:
    """The console's first line: the run's size, its devices and processes, the backend."""
    return (
        f"{name}: {sizes.num_updates} update{'s' * (sizes.num_updates != 1)} of "
        f"{sizes.steps_per_update} environment steps "
        f"({sizes.num_envs} environments), {num_learner_devices} learner device(s), "
        f"{jax.process_count()} process(es), JAX backend {backend}"
        f"{accelerators.backend_note(args, backend)}"
        f"{accelerators.platform_defaults_note(backend)}; a line at "
        f"least every {PROGRESS_SECONDS:.0f} s"
    )
