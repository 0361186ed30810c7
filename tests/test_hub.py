"""--upload-model: the folder that goes to the Hugging Face Hub (its files, the card's fields), the
calls into huggingface_hub with its API object replaced (the Hub is not reachable from here), the
line and the exit code of a run that could not upload, and `python -m cleanba_utils.evaluate`
loading a model back from a Hub repository id, downloaded as a local folder."""

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import huggingface_hub
import huggingface_hub.errors
import numpy as np
import pytest
from helpers import REPO, assert_refused, hub_api_stand_in, scalars

from cleanba import cleanba_apex_dqn, cleanba_ppo
from cleanba_utils import evaluate, hub

SEED = 1
EVAL_SEED = SEED + 1_000_000
# The smallest run of each script that finishes an update, on CartPole-v1 or Hopper-v4, whose
# episodes are short whatever the policy (10 evaluation episodes take a second).
CARTPOLE = ["--env-id", "CartPole-v1", "--log-frequency", "1"]
HOPPER = ["--env-id", "Hopper-v4", "--log-frequency", "1"]
ONE_THREAD = ["--local-num-envs", "4", "--num-actor-threads", "1"]
TINY = {
    "cleanba_ppo": [
        *CARTPOLE,
        *ONE_THREAD,
        *["--hiddens", "16", "--num-steps", "8", "--num-minibatches", "2"],
        *["--update-epochs", "1", "--total-timesteps", "64"],
    ],
    "cleanba_impala": [
        *CARTPOLE,
        *ONE_THREAD,
        *["--hiddens", "16", "--num-steps", "8", "--num-minibatches", "2"],
        *["--total-timesteps", "64"],
    ],
    "cleanba_apex_dqn": [
        *CARTPOLE,
        *ONE_THREAD,
        *["--hiddens", "16", "16", "--num-steps", "8", "--total-timesteps", "96"],
        *["--learning-starts", "32", "--batch-size", "16", "--updates-per-rollout", "1"],
        *["--buffer-size", "256"],
    ],
    "cleanba_gala_a2c": [
        *CARTPOLE,
        *["--num-agents", "2", "--hiddens", "16", "--local-num-envs", "2", "--num-steps", "4"],
        *["--total-timesteps", "32", "--similarity-every", "1000"],
    ],
    "cleanba_ppo_continuous": [
        *HOPPER,
        *ONE_THREAD,
        *["--hiddens", "16", "16", "--num-steps", "8", "--num-minibatches", "2"],
        *["--update-epochs", "1", "--total-timesteps", "64"],
    ],
    "cleanba_sac": [
        *HOPPER,
        *ONE_THREAD,
        *["--hiddens", "16", "16", "--num-steps", "8", "--total-timesteps", "96"],
        *["--learning-starts", "32", "--batch-size", "16", "--buffer-size", "256"],
    ],
    "cleanba_apex_dpg": [
        *HOPPER,
        *ONE_THREAD,
        *["--critic-hiddens", "16", "16", "--actor-hiddens", "16", "16", "--num-steps", "8"],
        *["--total-timesteps", "96", "--learning-starts", "32", "--random-steps", "16"],
        *["--buffer-size", "256", "--batch-size", "16", "--updates-per-rollout", "2"],
        *["--steps-per-call", "2", "--target-update-period", "4"],
    ],
}
# Three scripts evaluate during the run (the upload takes that evaluation's episodes); the others
# make no evaluation, so the upload plays its 10. Two name their entity; the others take the token's
# user, which the replaced API's whoami answers.
EVAL_EPISODES = {"cleanba_ppo": 2, "cleanba_apex_dqn": 2, "cleanba_sac": 2}
ENTITIES = {"cleanba_impala": "an-org", "cleanba_apex_dpg": "an-org"}
TOKEN_USER = "token-user"
UPLOAD = ["--save-model", "--upload-model", "--seed", str(SEED)]


def argv_of(script: str) -> list[str]:
    argv = [*TINY[script], *UPLOAD, "--eval-episodes", str(EVAL_EPISODES.get(script, 0))]
    if script in ENTITIES:
        argv += ["--hf-entity", ENTITIES[script]]
    return [*argv, "--run-name", script]


def repo_id_of(script: str, argv: list[str]) -> str:
    env_id = argv[argv.index("--env-id") + 1]
    return f"{ENTITIES.get(script, TOKEN_USER)}/{env_id}-{script}-seed{SEED}"


# Runs every script's main in one process (an import of JAX and envpool takes seconds), with
# huggingface_hub.HfApi replaced by tests/helpers.py's `hub_api_stand_in` (autospecced from the
# real class), which copies the uploaded folder to uploaded/<repo id>; each run's calls to it are
# saved as [method, positional arguments, keyword arguments]. sys.argv is the command a user would
# type: spec.json records it. The last command runs without a token; its exit code and stderr are
# saved.
DRIVER = """
import contextlib
import importlib
import io
import json
import os
import sys
from pathlib import Path

import huggingface_hub

sys.path.insert(0, sys.argv[2])
from helpers import hub_api_stand_in

huggingface_hub.HfApi = hub_api_stand_in()
api = huggingface_hub.HfApi.return_value
for command in json.loads(sys.argv[1]):
    script = importlib.import_module(f"cleanba.{command['script']}")
    sys.argv = [f"cleanba/{command['script']}.py", *command["argv"]]
    api.reset_mock()
    calls = api.mock_calls
    if command.get("no_token"):
        del os.environ["HF_TOKEN"]
        captured = io.StringIO()
        with contextlib.redirect_stderr(captured):
            try:
                script.main(command["argv"])
                code = 0
            except SystemExit as exit_:
                code = exit_.code
        Path("no_token.json").write_text(
            json.dumps(dict(code=code, stderr=captured.getvalue(), calls=list(map(list, calls))))
        )
        continue
    script.main(command["argv"])
    Path(f"{command['name']}.calls.json").write_text(json.dumps(list(map(list, calls))))
"""

NO_TOKEN_ARGV = [*TINY["cleanba_ppo"], *UPLOAD, "--hf-entity", "an-org", "--run-name", "no_token"]


@pytest.fixture(scope="module")
def uploads(tmp_path_factory):
    """The working folder of the driver's runs."""
    cwd = tmp_path_factory.mktemp("uploads")
    commands = [dict(script=script, name=script, argv=argv_of(script)) for script in TINY]
    commands.append(dict(script="cleanba_ppo", name="no_token", argv=NO_TOKEN_ARGV, no_token=True))
    env = dict(
        PYTHONPATH=str(REPO),
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        HF_TOKEN="hf_test_token",
        HF_HOME=str(cwd / "hf_home"),
    )
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands), str(REPO / "tests")],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (cwd / "driver.stdout").write_text(result.stdout)
    return cwd


@pytest.mark.parametrize("script", list(TINY))
def test_upload_hands_the_folder_to_the_hub_client(uploads, script):
    argv = argv_of(script)
    repo_id = repo_id_of(script, argv)
    run_dir = uploads / "runs" / script
    folder = run_dir / hub.FOLDER
    env_id = argv[argv.index("--env-id") + 1]
    calls = json.loads((uploads / f"{script}.calls.json").read_text())
    commit_message = calls[-1][2]["commit_message"]
    folder_path = str(Path("runs") / script / hub.FOLDER)
    expected = [] if script in ENTITIES else [["whoami", [], {}]]
    expected += [
        ["create_repo", [repo_id], {"exist_ok": True}],
        [
            "upload_folder",
            [],
            dict(repo_id=repo_id, folder_path=folder_path, commit_message=commit_message),
        ],
    ]
    assert calls == expected
    assert env_id in commit_message

    uploaded = uploads / "uploaded" / repo_id
    model = f"{script}.cleanba_model"
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(
        [model, "spec.json", "results.json", "README.md"]
    )
    assert (uploaded / model).read_bytes() == (run_dir / model).read_bytes()
    assert (uploaded / "spec.json").read_bytes() == (run_dir / "spec.json").read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in uploaded.iterdir())

    summary = json.loads((run_dir / "summary.json").read_text())
    results = json.loads((uploaded / "results.json").read_text())
    assert results["params_fingerprint"] == summary["params_fingerprint"]
    assert results["global_step"] == summary["global_step"]
    evaluation = results["evaluation"]
    if script in EVAL_EPISODES:
        # The run's final evaluation, as TensorBoard logged its episodes.
        logged = [value for _, value in scalars(run_dir, "eval/episodic_return")]
        assert evaluation["episodes"] == EVAL_EPISODES[script]
        np.testing.assert_allclose(evaluation["returns"], logged, rtol=1e-6)
        assert summary["eval_return"] == pytest.approx(np.mean(logged), rel=1e-6)
    else:
        assert evaluation["episodes"] == hub.UPLOAD_EVAL_EPISODES == 10
        assert "eval_return" not in summary
    assert evaluation["mean_return"] == pytest.approx(np.mean(evaluation["returns"]))
    assert evaluation["first_seed"] == EVAL_SEED

    metadata = huggingface_hub.metadata_load(uploaded / "README.md")
    card_facts = importlib.import_module(f"cleanba.{script}").MODEL_CARD
    algorithm = card_facts.name
    assert metadata["library_name"] == "cleanba"
    assert env_id in metadata["tags"]
    [model_index] = metadata["model-index"]
    [result] = model_index["results"]
    assert model_index["name"] == algorithm
    assert result["dataset"]["name"] == env_id
    mean, std = np.mean(evaluation["returns"]), np.std(evaluation["returns"])
    assert result["metrics"][0]["value"] == f"{mean:.2f} +/- {std:.2f}"

    card = (uploaded / "README.md").read_text()
    command = f"python cleanba/{script}.py {shlex.join(argv)}"
    assert f"```bash\n{command}\n```" in card
    assert f"# {algorithm} playing {env_id}" in card
    assert f"| environment | `{env_id}` (envpool) |" in card
    assert f"{mean:.2f} ± {std:.2f} over {evaluation['episodes']} episodes" in card
    training = results["final_training"]
    if training["episodes"]:
        assert f"{training['mean_return']:.2f} ± " in card
        assert f"over {training['episodes']} episode" in card
    assert f"python -m cleanba_utils.evaluate {repo_id} --episodes {evaluation['episodes']}" in card
    for paper in card_facts.papers:
        assert paper.url in card
    assert f"seeds {EVAL_SEED} to {EVAL_SEED + evaluation['episodes'] - 1}" in card


@pytest.mark.parametrize("script", list(TINY))
def test_evaluate_loads_the_uploaded_model_by_its_repository_id(
    uploads, script, monkeypatch, capsys
):
    """`python -m cleanba_utils.evaluate ENTITY/NAME` downloads the repository (here a local folder
    in the Hub's layout) and plays the evaluation that the card reports, episode for episode."""
    argv = argv_of(script)
    repo_id = repo_id_of(script, argv)
    uploaded = uploads / "uploaded" / repo_id
    downloads = []

    def snapshot_download(repo_id, **options):
        downloads.append(repo_id)
        return str(uploaded)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", autospecced(snapshot_download))
    monkeypatch.chdir(uploads)
    results = json.loads((uploaded / "results.json").read_text())
    episodes = results["evaluation"]["episodes"]
    evaluate.main([repo_id, "--episodes", str(episodes), "--json"])
    played = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert downloads == [repo_id]
    assert played["env_id"] == argv[argv.index("--env-id") + 1]
    np.testing.assert_allclose(played["returns"], results["evaluation"]["returns"], rtol=1e-6)


def test_a_run_without_a_token_keeps_its_model_and_says_so_in_one_line(uploads):
    no_token = json.loads((uploads / "no_token.json").read_text())
    run_dir = Path("runs") / "no_token"
    assert no_token["code"] == hub.UPLOAD_FAILED_EXIT_CODE == 3
    assert no_token["calls"] == []
    lines = no_token["stderr"].strip().splitlines()
    assert lines[-1].startswith(f"the model stays in {run_dir}; ")
    assert "no Hugging Face token" in lines[-1]
    for name in ["cleanba_ppo.cleanba_model", "spec.json", "summary.json"]:
        assert (uploads / run_dir / name).is_file()
    # The run said so when it started too; the runs that had a token did not.
    stdout = (uploads / "driver.stdout").read_text()
    assert stdout.count("note: --upload-model: no Hugging Face token here") == 1


def autospecced(snapshot_download):
    """huggingface_hub.snapshot_download autospecced from the installed function (a call its
    signature refuses raises TypeError), answering as `snapshot_download`."""
    return mock.create_autospec(huggingface_hub.snapshot_download, side_effect=snapshot_download)


def failing_api(error: Exception):
    """The Hub's API, autospecced, whose create_repo raises `error`."""
    api_class = hub_api_stand_in()
    api_class.return_value.create_repo.side_effect = error
    return api_class


def test_the_hub_stand_in_refuses_what_the_installed_hub_would(tmp_path):
    """The tests' HfApi has the signatures of the installed huggingface_hub's: a keyword it does not
    take, an argument it needs left out, a keyword-only one given by position, a method it lacks,
    all fail as against the Hub; the calls that cleanba_utils.hub makes go through."""
    api = hub_api_stand_in(uploaded=str(tmp_path / "uploaded"))()
    with pytest.raises(TypeError, match="exists_ok"):
        api.create_repo("an-org/model", exists_ok=True)
    with pytest.raises(TypeError, match="folder_path"):
        api.upload_folder(repo_id="an-org/model", folder="hub", commit_message="a model")
    with pytest.raises(TypeError):
        api.upload_folder("an-org/model", folder_path="hub", commit_message="a model")
    with pytest.raises(AttributeError):
        api.upload_model()
    (tmp_path / "hub").mkdir()
    assert api.create_repo("an-org/model", exist_ok=True) == "https://huggingface.co/an-org/model"
    api.upload_folder(repo_id="an-org/model", folder_path=str(tmp_path / "hub"), commit_message="m")
    assert (tmp_path / "uploaded" / "an-org" / "model").is_dir()
    assert api.whoami() == {"name": TOKEN_USER}


@pytest.mark.parametrize(
    "error",
    [
        huggingface_hub.errors.HTTPError("[Errno -2] Name or service not known"),
        huggingface_hub.errors.LocalTokenNotFoundError("the token is not valid"),
    ],
    ids=["no_network", "refused"],
)
def test_a_failed_upload_keeps_the_folder_and_names_the_command_that_uploads_it(
    tmp_path, monkeypatch, error
):
    run_dir, model_path, args = fake_run(tmp_path)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub, "HfApi", failing_api(error))
    played = []
    line = hub.upload_run(
        args,
        str(run_dir),
        "cleanba/cleanba_ppo.py",
        str(model_path),
        card=cleanba_ppo.MODEL_CARD,
        eval_returns=None,
        play=lambda episodes: played.append(episodes) or [float(i) for i in range(episodes)],
        eval_seed=EVAL_SEED,
        training_returns=[9.0, 11.0],
        global_step=128,
        params_fingerprint="ab" * 32,
    )
    repo_id = f"an-org/CartPole-v1-cleanba_ppo-seed{SEED}"
    folder = run_dir / hub.FOLDER
    assert played == [hub.UPLOAD_EVAL_EPISODES]
    assert line == (
        f"the model stays in {run_dir}; it was not uploaded to {repo_id}: the Hugging Face Hub "
        f"refused it or could not be reached: {type(error).__name__}: {error}; "
        f"`hf upload {repo_id} {folder} .` uploads its folder"
    )
    assert (folder / "README.md").is_file()
    assert (folder / "cleanba_ppo.cleanba_model").read_bytes() == model_path.read_bytes()


def fake_run(tmp_path: Path):
    """A run folder as a finished run leaves it (spec.json, a model file) and its Args."""
    argv = ["--env-id", "CartPole-v1", "--save-model", "--upload-model", "--hf-entity", "an-org"]
    args = cleanba_ppo.parse_args(argv)
    run_dir = tmp_path / "runs" / "fake"
    run_dir.mkdir(parents=True)
    spec = dict(script="cleanba_ppo.py", command=["cleanba/cleanba_ppo.py", *argv], git_sha=None)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    model_path = run_dir / "cleanba_ppo.cleanba_model"
    model_path.write_bytes(b"model bytes")
    return run_dir, model_path, args


def test_the_card_of_a_run_folder(tmp_path):
    run_dir, model_path, args = fake_run(tmp_path)
    results = hub.results_record(
        args,
        cleanba_ppo.MODEL_CARD,
        training_returns=[10.0, 20.0, 30.0],
        eval_returns=[100.0, 200.0],
        eval_seed=EVAL_SEED,
        eval_made_by="the run's final evaluation (--eval-episodes)",
        global_step=4096,
        params_fingerprint="cd" * 32,
    )
    repo_id = "an-org/CartPole-v1-cleanba_ppo-seed1"
    folder = Path(
        hub.build_folder(
            str(run_dir), str(model_path), repo_id, args, cleanba_ppo.MODEL_CARD, results
        )
    )
    card = (folder / "README.md").read_text()
    assert "| final training return | 20.00 ± 8.16 over 3 episodes" in card
    assert (
        "| evaluation return | 150.00 ± 50.00 over 2 episodes, the run's final evaluation" in card
    )
    assert "seeds 1000001 to 1000002; actions sampled from the policy π |" in card
    assert "| training | 4096 environment steps, seed 1 |" in card
    assert "| code | not recorded (not a git checkout) |" in card
    assert "python cleanba/cleanba_ppo.py --env-id CartPole-v1 --save-model --upload-model" in card
    assert "https://arxiv.org/abs/2310.00036" in card and "https://arxiv.org/abs/1707.06347" in card
    assert json.loads((folder / "results.json").read_text()) == results


def test_every_script_declares_its_algorithm_and_papers():
    scripts = sorted(path.stem for path in (REPO / "cleanba").glob("cleanba_*.py"))
    assert len(scripts) == 7
    for name in scripts:
        card = importlib.import_module(f"cleanba.{name}").MODEL_CARD
        assert isinstance(card, hub.ModelCard) and card.name, name
        assert card.papers, name
        assert all(paper.url.startswith("https://arxiv.org/abs/") for paper in card.papers)


def test_the_ape_x_dqn_card_gives_the_epsilon_of_its_evaluation():
    policy = cleanba_apex_dqn.MODEL_CARD.evaluation_policy(None)
    assert f"ε = {cleanba_apex_dqn.EVAL_EPSILON}" in policy
    assert not policy.startswith("greedy")


def test_a_script_without_a_card_uploads_under_its_own_name(tmp_path):
    """A new script that declares no `MODEL_CARD` (the minimal example's shape): the card names
    the script's file and says it names no paper, instead of failing at the end of training."""
    run_dir, model_path, args = fake_run(tmp_path)
    card = hub.card_of_unnamed("cleanba_mine")
    results = hub.results_record(
        args,
        card,
        training_returns=[1.0],
        eval_returns=[2.0],
        eval_seed=EVAL_SEED,
        eval_made_by="played for the upload (the run made no evaluation)",
        global_step=64,
        params_fingerprint="ab" * 32,
    )
    folder = hub.build_folder(str(run_dir), str(model_path), "me/x", args, card, results)
    text = (Path(folder) / "README.md").read_text()
    assert "# cleanba_mine playing CartPole-v1" in text
    assert "None named by the script." in text
    assert "as `cleanba_mine.py`'s `evaluate` plays" in text


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--upload-model"], "--upload-model"),
        (["--hf-entity", "an-org", "--save-model"], "--hf-entity"),
        (["--save-model", "--upload-model", "--exp-name", "two words"], "--exp-name"),
        (["--save-model", "--upload-model", "--hf-entity", "an/org"], "--hf-entity"),
    ],
    ids=["without_save_model", "entity_without_upload", "bad_name", "bad_entity"],
)
def test_upload_options_that_cannot_act_are_refused_in_one_line(argv, option, capsys):
    assert_refused(cleanba_ppo, ["--env-id", "CartPole-v1", *argv], option, capsys)


def test_a_path_is_a_path_and_entity_name_a_repository_id(tmp_path, monkeypatch):
    run_dir, model_path, _ = fake_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    downloads = []

    def snapshot_download(repo_id, **options):
        downloads.append(repo_id)
        return str(run_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", autospecced(snapshot_download))
    # An existing file or folder is read from disk, even when it looks like `entity/name`.
    assert evaluate.model_file("runs/fake") == str(Path("runs/fake") / model_path.name)
    assert evaluate.model_file(str(model_path)) == str(model_path)
    assert downloads == []
    # A path that does not exist, of the form entity/name, is a repository id.
    assert evaluate.model_file("an-org/model") == str(run_dir / model_path.name)
    assert downloads == ["an-org/model"]
    with pytest.raises(FileNotFoundError):
        evaluate.model_file("runs/fake/missing.cleanba_model")
    shutil.copy(model_path, run_dir / "another.cleanba_model")
    with pytest.raises(OSError, match=r"exactly one \.cleanba_model"):
        evaluate.model_file("runs/fake")
    assert downloads == ["an-org/model"]


def test_a_repository_that_cannot_be_downloaded_is_one_line(tmp_path, monkeypatch, capsys):
    def snapshot_download(repo_id, **options):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection\nand more")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", autospecced(snapshot_download))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["an-org/model"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: cannot read an-org/model: no such file or folder here, nor a Hugging Face Hub "
        "repository to download (LocalEntryNotFoundError: no connection)\n"
    )
