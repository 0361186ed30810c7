"""No two things in `cleanba_utils` share a name: a function, class or module-level constant is
named once in the package, so a name read in a script points at one thing. `main`, the entry point
of each `python -m cleanba_utils....` command, is the one name that modules share by design."""

import ast
import collections

from helpers import REPO

ENTRY_POINT = "main"


def top_level_names(source: str) -> list[str]:
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [target.id for target in targets if isinstance(target, ast.Name)]
    return names


def shared_names(package) -> dict:
    modules = collections.defaultdict(list)
    for path in sorted(package.rglob("*.py")):
        for name in set(top_level_names(path.read_text())):
            if not name.startswith("_") and name != ENTRY_POINT:
                modules[name].append(str(path.relative_to(package)))
    return {name: paths for name, paths in modules.items() if len(paths) > 1}


def test_no_two_things_in_the_package_share_a_name():
    assert shared_names(REPO / "cleanba_utils") == {}


def test_the_check_finds_a_name_defined_in_two_modules(tmp_path):
    (tmp_path / "a.py").write_text("LIMIT = 1\n\ndef main():\n    pass\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("LIMIT: int = 2\n\ndef main():\n    pass\n")
    assert shared_names(tmp_path) == {"LIMIT": ["a.py", "sub/b.py"]}
