"""What `uv run --extra cuda` and `poetry install --extras cuda` install, read from the locks: no
machine of the suite has an NVIDIA GPU, so the locked CUDA stack is checked here and nowhere else.
The cuda extra resolves to JAX's CUDA 13 plugins at the locked jaxlib's version (a plugin of another
version refuses to load beside that jaxlib), and every supported Python gets one locked version of
the libraries the suite tests (jax, jaxlib, numpy, envpool)."""

import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_PACKAGES = ("jax-cuda13-plugin", "jax-cuda13-pjrt")
ONE_STACK = ("jax", "jaxlib", "numpy", "envpool")


def uv_packages(lock: dict) -> dict[str, list[dict]]:
    """uv.lock's packages by name; a name locked for several Pythons has one entry per version."""
    packages = {}
    for package in lock["package"]:
        packages.setdefault(package["name"], []).append(package)
    return packages


def locked(packages: dict, reference: dict) -> dict:
    """The package a dependency entry of uv.lock means: it names a version only where the lock holds
    several of that package."""
    candidates = packages[reference["name"]]
    if "version" in reference:
        candidates = [c for c in candidates if c["version"] == reference["version"]]
    assert len(candidates) == 1, reference
    return candidates[0]


def uv_cuda_stack(lock: dict) -> list[tuple[str, str, str, str]]:
    """For each jax the cuda extra may install (one per locked version): the version of the jaxlib
    it needs, its plugin and PJRT packages as NAME==VERSION, and the extra of jax the cuda extra
    asks for."""
    packages = uv_packages(lock)
    (cleanba,) = packages["cleanba"]
    stacks = []
    for request in cleanba["optional-dependencies"]["cuda"]:
        assert request["name"] == "jax", request
        (extra,) = request["extra"]
        jax = locked(packages, request)
        jax_extra = jax["optional-dependencies"][extra]
        jaxlib = locked(packages, next(dep for dep in jax_extra if dep["name"] == "jaxlib"))
        plugin = locked(packages, next(dep for dep in jax_extra if dep["name"] != "jaxlib"))
        pjrt = locked(
            packages, next(dep for dep in plugin["dependencies"] if "pjrt" in dep["name"])
        )
        stacks.append(
            (
                jaxlib["version"],
                f"{plugin['name']}=={plugin['version']}",
                f"{pjrt['name']}=={pjrt['version']}",
                extra,
            )
        )
    return stacks


def test_uv_lock_resolves_the_cuda_extra_to_cuda13_plugins_of_the_locked_jaxlib():
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    stacks = uv_cuda_stack(lock)
    assert stacks
    for jaxlib, plugin, pjrt, extra in stacks:
        assert extra == "cuda13"
        assert [plugin, pjrt] == [f"{name}=={jaxlib}" for name in CUDA_PACKAGES]


@pytest.mark.parametrize("name", ONE_STACK)
def test_uv_lock_gives_every_python_one_version(name):
    packages = uv_packages(tomllib.loads((REPO / "uv.lock").read_text()))
    assert [package["version"] for package in packages[name]] == [packages[name][0]["version"]]


def test_poetry_lock_holds_the_same_cuda13_plugins():
    packages = uv_packages(tomllib.loads((REPO / "poetry.lock").read_text()))
    for name in (*ONE_STACK, *CUDA_PACKAGES):
        assert len(packages[name]) == 1, name
    (jaxlib,) = packages["jaxlib"]
    for name in CUDA_PACKAGES:
        (package,) = packages[name]
        assert package["version"] == jaxlib["version"], name
        assert package["markers"] == 'extra == "cuda"', name
    assert not [name for name in packages if name.startswith("jax-cuda") and "cuda13" not in name]
