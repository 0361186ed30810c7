"""Models on the Hugging Face Hub.

`--upload-model` (with `--save-model`): at the end of the run, process 0 builds the folder
`runs/{run_name}/hub/` (the model file, spec.json, results.json with the final training return and
the evaluation's returns, and a model card, README.md) and uploads it to the model repository
`{hf_entity}/{env_id}-{exp_name}-seed{seed}`, the name that the original Cleanba and CleanRL give
it. Without a token or a network the run still ends with all its files, and one line says why the
model was not uploaded (exit code UPLOAD_FAILED_EXIT_CODE).

`python -m cleanba_utils.evaluate ENTITY/NAME` downloads such a repository (`download`) and plays
the model in it (`model_in_folder`).

huggingface_hub is imported by the functions that use it: a script that refuses an option does not
wait for it."""

import json
import os
import re
import shlex
import shutil
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from cleanba_utils import run_files
from cleanba_utils.env_ids import is_gymnasium_env, is_jax_env, name_part
from cleanba_utils.errors import fail

UPLOAD_EVAL_EPISODES = 10
"""the episodes that the upload plays for the card when the run made no evaluation
(--eval-episodes 0), as CleanRL does"""
UPLOAD_FAILED_EXIT_CODE = 3
"""the exit code of a run that trained and wrote all its files, the model included, but could not
upload the model"""
FOLDER = "hub"
"""the folder of the run folder that is uploaded"""
RESULTS_FILE = "results.json"
CARD_FILE = "README.md"
REPOSITORY_ID = re.compile(r"[^/\s]+/[^/\s]+")
"""the form of a Hub repository id, `entity/name` (the Hub's own check of its characters is
`validate_repo_id`)"""


class Paper(NamedTuple):
    citation: str
    url: str


CLEANBA = Paper(
    "Huang et al. (2023), *Cleanba: A Reproducible and Efficient Distributed Reinforcement "
    "Learning Platform*",
    "https://arxiv.org/abs/2310.00036",
)
PPO = Paper(
    "Schulman et al. (2017), *Proximal Policy Optimization Algorithms*",
    "https://arxiv.org/abs/1707.06347",
)
IMPALA = Paper(
    "Espeholt et al. (2018), *IMPALA: Scalable Distributed Deep-RL with Importance Weighted "
    "Actor-Learner Architectures*",
    "https://arxiv.org/abs/1802.01561",
)
APE_X = Paper(
    "Horgan et al. (2018), *Distributed Prioritized Experience Replay*",
    "https://arxiv.org/abs/1803.00933",
)
GALA = Paper(
    "Assran et al. (2019), *Gossip-based Actor-Learner Architectures for Deep Reinforcement "
    "Learning*",
    "https://arxiv.org/abs/1906.04585",
)
SAC = Paper(
    "Haarnoja et al. (2018), *Soft Actor-Critic Algorithms and Applications*",
    "https://arxiv.org/abs/1812.05905",
)


class ModelCard(NamedTuple):
    """What a script's model card says of its algorithm, declared by the script (`MODEL_CARD`,
    given to `open_run`)."""

    name: str
    papers: tuple[Paper, ...]
    evaluation_policy: Callable
    """how the script's `evaluate` chooses actions, a function of the run's Args"""


def card_of_unnamed(script: str) -> ModelCard:
    """The card of a script that declares none: its file name, no paper."""
    return ModelCard(
        name=script,
        papers=(),
        evaluation_policy=lambda args: f"as `{script}.py`'s `evaluate` plays",
    )


class UploadFailed(Exception):
    """Why the model was not uploaded, in one line."""


def repository_name(args) -> str:
    return f"{name_part(args.env_id)}-{args.exp_name}-seed{args.seed}"


def check_repository(args):
    """Refuses (exit 2), when the run starts, a repository id that the Hub would refuse at its
    end."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    name = repository_name(args)
    repo_id = name if args.hf_entity is None else f"{args.hf_entity}/{name}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        fail(
            f"--upload-model: {repo_id} is not a Hugging Face Hub repository id (letters, digits, "
            "'-', '_' and '.', no '--' or '..', at most 96 characters each side of the '/'); "
            "choose another --exp-name or --hf-entity"
        )


def note_missing_token():
    """At the start of a run with --upload-model: a line if no token is at hand, while there is time
    to give one (the upload reads it at the end of the run)."""
    from huggingface_hub import get_token

    if get_token() is None:
        print(
            "note: --upload-model: no Hugging Face token here (HF_TOKEN, or `hf auth login`); the "
            "upload at the end of the run needs one",
            flush=True,
        )


def first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def ask_hub(call: Callable):
    """`call()`, a request to the Hub; a refusal or no answer raises UploadFailed."""
    from huggingface_hub.errors import HTTPError

    try:
        return call()
    except (OSError, HTTPError) as error:
        # huggingface_hub's errors (no token, an HTTP error status, offline mode) are OSErrors; its
        # HTTP client's (no network) derive from HTTPError.
        raise UploadFailed(
            f"the Hugging Face Hub refused it or could not be reached: {first_line(error)}"
        ) from error


def repository_id(args) -> str:
    """`{hf_entity}/{name}`; without --hf-entity the token's user (the Hub's whoami)."""
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise UploadFailed("no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    entity = args.hf_entity
    if entity is None:
        entity = ask_hub(lambda: HfApi().whoami()["name"])
    return f"{entity}/{repository_name(args)}"


def returns_record(returns) -> dict:
    returns = [float(r) for r in returns]
    return dict(
        episodes=len(returns),
        mean_return=float(np.mean(returns)) if returns else None,
        std_return=float(np.std(returns)) if returns else None,
        returns=returns,
    )


def results_record(
    args,
    card: ModelCard,
    *,
    training_returns,
    eval_returns,
    eval_seed: int,
    eval_made_by: str,
    global_step: int,
    params_fingerprint: str,
) -> dict:
    """results.json: the final training return and the evaluation's returns, each with its
    episodes."""
    evaluation = returns_record(eval_returns)
    evaluation.update(
        first_seed=eval_seed,
        policy=card.evaluation_policy(args),
        made_by=eval_made_by,
    )
    return dict(
        env_id=args.env_id,
        global_step=global_step,
        params_fingerprint=params_fingerprint,
        final_training=returns_record(training_returns),
        evaluation=evaluation,
    )


def mean_over(record: dict) -> str:
    """A mean return and the episodes it is over."""
    if not record["episodes"]:
        return "no episode finished"
    episodes = f"{record['episodes']} episode{'s' * (record['episodes'] != 1)}"
    return f"{record['mean_return']:.2f} ± {record['std_return']:.2f} over {episodes}"


def training_command(spec: dict) -> str:
    """The run's command as spec.json records it (its first run's, a resumed run's without
    --resume), with the script named from the repository root."""
    return shlex.join(["python", f"cleanba/{spec['script']}", *spec["command"][1:]])


def code_version(spec: dict) -> str:
    if spec["git_sha"] is None:
        return "not recorded (not a git checkout)"
    return f"git commit {spec['git_sha']}"


def model_card(args, card: ModelCard, repo_id: str, spec: dict, results: dict) -> str:
    """The card's text, below its metadata."""
    algorithm = card
    evaluation = results["evaluation"]
    last_seed = evaluation["first_seed"] + evaluation["episodes"] - 1
    papers = "\n".join(f"- {paper.citation}, {paper.url}" for paper in algorithm.papers)
    papers = papers or "None named by the script."
    source = "envpool"
    if is_jax_env(args.env_id):
        source = "a JAX environment"
    if is_gymnasium_env(args.env_id):
        source = "a Gymnasium environment"
    parameters = f", `--env-params {' '.join(args.env_params)}`" if args.env_params else ""
    return f"""# {algorithm.name} playing {args.env_id}

A model trained by Cleanba's `cleanba/{spec["script"]}` on `{args.env_id}` ({source}) and
uploaded by its `--upload-model`.

| | |
|---|---|
| algorithm | {algorithm.name} (`cleanba/{spec["script"]}`) |
| environment | `{args.env_id}` ({source}{parameters}) |
| training | {results["global_step"]} environment steps, seed {args.seed} |
| code | {code_version(spec)} |
| final training return | {mean_over(results["final_training"])}: the last finished training \
episodes of process 0's actors (up to 100) |
| evaluation return | {mean_over(evaluation)}, {evaluation["made_by"]}: one episode per \
environment, seeds {evaluation["first_seed"]} to {last_seed}; {evaluation["policy"]} |
| parameters | `params_fingerprint` {results["params_fingerprint"]} |

The returns of every episode are in `{RESULTS_FILE}`; every option, the derived sizes and the
library versions in `spec.json`.

## Paper

{papers}

## Load and play it

In a checkout of Cleanba (the commit above) with its environment (`uv sync`):

```bash
uv run python -m cleanba_utils.evaluate {repo_id} --episodes {evaluation["episodes"]}
```

downloads this repository and plays the model with the script's own network, environments and
evaluation policy, in the environments of the evaluation above (the run's seed + 1,000,000;
`--seed` sets another).

## The command that trained it

```bash
{training_command(spec)}
```
"""


def card_metadata(args, card: ModelCard, results: dict) -> dict:
    """The card's metadata: the Hub's tags and its model-index of the evaluation's mean return."""
    from huggingface_hub import metadata_eval_result

    algorithm = card
    evaluation = results["evaluation"]
    return dict(
        library_name="cleanba",
        tags=[args.env_id, "reinforcement-learning", "deep-reinforcement-learning", "cleanba"],
        **metadata_eval_result(
            model_pretty_name=algorithm.name,
            task_pretty_name="reinforcement-learning",
            task_id="reinforcement-learning",
            metrics_pretty_name="mean_reward",
            metrics_id="mean_reward",
            metrics_value=f"{evaluation['mean_return']:.2f} +/- {evaluation['std_return']:.2f}",
            dataset_pretty_name=args.env_id,
            dataset_id=args.env_id,
        ),
    )


def build_folder(
    run_dir: str, model_path: str, repo_id: str, args, card: ModelCard, results
) -> str:
    """The folder that is uploaded, `FOLDER` in the run folder: the model file, spec.json,
    results.json and the card. A file that cannot be written raises UploadFailed."""
    from huggingface_hub import metadata_save

    folder = os.path.join(run_dir, FOLDER)
    spec_path = os.path.join(run_dir, "spec.json")
    card_path = os.path.join(folder, CARD_FILE)
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        os.makedirs(folder, exist_ok=True)
        shutil.copy2(model_path, folder)
        shutil.copy2(spec_path, folder)
        run_files.write_json_atomically(os.path.join(folder, RESULTS_FILE), results)
        with run_files.atomic_file(card_path, "w") as f:
            f.write(model_card(args, card, repo_id, spec, results))
        metadata_save(card_path, card_metadata(args, card, results))
    except OSError as error:
        raise UploadFailed(first_line(error)) from error
    return folder


def upload_folder(folder: str, repo_id: str, commit_message: str) -> str:
    """Uploads `folder` to the model repository `repo_id` (made if it does not exist); returns its
    address."""
    from huggingface_hub import HfApi

    api = HfApi()
    url = ask_hub(lambda: api.create_repo(repo_id, exist_ok=True))
    ask_hub(
        lambda: api.upload_folder(
            repo_id=repo_id, folder_path=folder, commit_message=commit_message
        )
    )
    return str(url)


def upload_run(
    args,
    run_dir: str,
    script_path: str,
    model_path: str,
    *,
    card: ModelCard | None,
    eval_returns,
    play: Callable,
    eval_seed: int,
    training_returns,
    global_step: int,
    params_fingerprint: str,
) -> str | None:
    """--upload-model, in process 0 at the end of the run: the repository id, the evaluation
    (`eval_returns`, the run's final one; None: `play(UPLOAD_EVAL_EPISODES)` plays it), the folder
    and its upload. `card`: the script's `MODEL_CARD` (None: `card_of_unnamed`). Returns the line
    that says why the model was not uploaded, or None."""
    script = os.path.splitext(os.path.basename(script_path))[0]
    card = card or card_of_unnamed(script)
    folder = None
    try:
        repo_id = repository_id(args)
        eval_made_by = "the run's final evaluation (--eval-episodes)"
        if eval_returns is None:
            eval_returns = play(UPLOAD_EVAL_EPISODES)
            eval_made_by = "played for the upload (the run made no evaluation)"
            print(
                f"eval: mean return {np.mean(eval_returns):.1f} over {len(eval_returns)} "
                "episodes, for the upload",
                flush=True,
            )
        results = results_record(
            args,
            card,
            training_returns=training_returns,
            eval_returns=eval_returns,
            eval_seed=eval_seed,
            eval_made_by=eval_made_by,
            global_step=global_step,
            params_fingerprint=params_fingerprint,
        )
        folder = build_folder(run_dir, model_path, repo_id, args, card, results)
        commit_message = f"{card.name} on {args.env_id}, seed {args.seed}"
        url = upload_folder(folder, repo_id, commit_message)
    except UploadFailed as failure:
        kept = f"the model stays in {run_dir}"
        if folder is None:
            return f"{kept}; it was not uploaded: {failure}"
        return (
            f"{kept}; it was not uploaded to {repo_id}: {failure}; "
            f"`hf upload {repo_id} {folder} .` uploads its folder"
        )
    print(f"model uploaded to {url}", flush=True)
    return None


def is_repository_id(source: str) -> bool:
    return REPOSITORY_ID.fullmatch(source) is not None


def download(repo_id: str) -> str:
    """The local folder of the Hub repository `repo_id`, downloaded (or found in huggingface_hub's
    cache). Raises OSError with the Hub's reason in one line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, HTTPError

    try:
        return snapshot_download(repo_id)
    except (OSError, HTTPError, HFValidationError) as error:
        raise OSError(first_line(error)) from error


def model_in_folder(folder: str) -> str:
    """The one model file of `folder` (a run folder, or a repository that --upload-model made).
    Raises OSError when there is none or more than one."""
    models = sorted(name for name in os.listdir(folder) if name.endswith(run_files.MODEL_SUFFIX))
    if len(models) != 1:
        found = ", ".join(models) if models else "none"
        raise OSError(
            f"{folder} must hold exactly one {run_files.MODEL_SUFFIX} file (found: {found})"
        )
    return os.path.join(folder, models[0])
