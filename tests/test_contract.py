"""Every script, and the minimal example of docs/writing_a_script.md, provides what
`cleanba_utils.contract` says the library and the tools read by name; a script missing one of those
names or fields fails the check; the names the suite replaces are module-level names of the scripts
and are named on the page."""

import importlib
import importlib.util
import types

import pytest
from helpers import REPO

from cleanba_utils import contract

SCRIPTS = sorted(path.stem for path in (REPO / "cleanba").glob("cleanba_*.py"))
MINIMAL = REPO / "docs" / "examples" / "cleanba_a2c_minimal.py"


def minimal_script():
    spec = importlib.util.spec_from_file_location("cleanba_a2c_minimal", MINIMAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modules():
    return [*(importlib.import_module(f"cleanba.{name}") for name in SCRIPTS), minimal_script()]


def test_every_script_provides_the_contract():
    assert len(SCRIPTS) == 7
    for module in modules():
        assert isinstance(module, contract.Script), module.__name__
        args = module.parse_args([])
        assert isinstance(args, contract.ScriptArgs), module.__name__
        source = (REPO / module.__file__).read_text()
        # GALA-A2C starts one actor thread per agent (`threads_per_device=1`) and makes its own
        # environments: it reads none of the actor threads' options.
        if "start_actor_threads(" in source and "threads_per_device=" not in source:
            assert isinstance(args, contract.ActorThreadArgs), module.__name__


def test_a_script_missing_a_name_or_a_field_fails_the_check():
    ppo = importlib.import_module("cleanba.cleanba_ppo")
    without_evaluate = types.ModuleType("without_evaluate")
    without_evaluate.__dict__.update({k: v for k, v in vars(ppo).items() if k != "evaluate"})
    assert isinstance(ppo, contract.Script)
    assert not isinstance(without_evaluate, contract.Script)
    args = ppo.parse_args([])
    fields = {name: getattr(args, name) for name in ("env_id", "total_timesteps")}
    assert not isinstance(types.SimpleNamespace(**fields), contract.ScriptArgs)
    assert isinstance(types.SimpleNamespace(**fields, local_num_envs=4), contract.ScriptArgs)
    assert not isinstance(
        types.SimpleNamespace(**fields, local_num_envs=4, num_actor_threads=1),
        contract.ActorThreadArgs,
    )


@pytest.mark.parametrize("name", sorted(contract.TEST_REPLACEMENTS))
def test_the_names_the_suite_replaces_are_module_names_named_on_the_page(name):
    page = (REPO / "docs" / "writing_a_script.md").read_text()
    assert f"`{name}`" in page
    tests = "\n".join(path.read_text() for path in (REPO / "tests").glob("*.py"))
    assert f"script.{name} = " in tests, f"the suite no longer replaces {name}: drop it"
    for module in modules():
        assert callable(getattr(module, name)), (module.__name__, name)


def test_the_keep_lag_scripts_leave_their_resume_to_the_library():
    """SAC, continuous PPO and Ape-X DPG resume bit for bit through `kept_lag` and
    `compiled_rollout`: none builds its checkpoint's host copy or records its environments
    itself."""
    own_plumbing = ["host_copy", "saved_of", "Checkpointable", "record_step", "fast_forward"]
    keep_lag = [m for m in modules() if getattr(m, "ON_RESUME", None) == "keep_lag"]
    assert sorted(m.__name__ for m in keep_lag) == [
        "cleanba.cleanba_apex_dpg",
        "cleanba.cleanba_ppo_continuous",
        "cleanba.cleanba_sac",
    ]
    for module in keep_lag:
        source = (REPO / module.__file__).read_text()
        assert "kept_lag.run_origin(" in source and "compiled_rollout.start" in source
        # Gymnasium's environments: the library's Python rollout keeps their records.
        assert "split_envs.start_splits, keep_record=True" in source
        assert [name for name in own_plumbing if name in source] == [], module.__name__
