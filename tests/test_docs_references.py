"""Every module, attribute, path and link that README.md and the docs name exists in the checkout today: a dotted
name (`jaxdp.engine.loop`, `jaxdp.ops.registry.OPS`, `jaxdp.parallel.step.StepRunner`) resolves to a module file
and then to names defined in it (read with ast; only a module's lazy __getattr__ is imported), a path
(`jaxdp/ops/`, `api/guard.py`, `tests/test_plan.py`) is a file or folder of the checkout, a relative markdown link
reaches a file. So a renamed or moved module cannot leave a doc naming it. Run as a script
(`python tests/test_docs_references.py`), it prints each stale reference with its page and line."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# jaxdp.a.b.C; not a file name's extension (`jaxdp.toml`) since every piece must look like a Python name
DOTTED = re.compile(r"(?<![\w./-])jaxdp(?:\.[A-Za-z_]\w*)+")
# jaxdp/a/b.py or jaxdp/a/; not a piece of a longer path (`~/.cache/jaxdp/xla`, `/tmp/jaxdp/...`)
PATH = re.compile(r"(?<![\w./~-])jaxdp/[\w./-]*")
# a file of the checkout named from its top folder (`tests/test_plan.py`, `benchmarks/results/peer.json`) or
# inside the package without its `jaxdp/` (`api/guard.py`, `step/pipeline.py`)
REPO_PATH = re.compile(r"(?<![\w./~-])(?:[\w-]+/)+[\w-]+\.(?:py|toml|sh|json|cc|md|png)\b")
TOP_FOLDERS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
PACKAGE_FOLDERS = {p.name for p in (ROOT / "jaxdp").rglob("*") if p.is_dir() and p.name != "__pycache__"}
PLACEHOLDERS = {"tests/test_x.py"}  # README's "run one test file" shows a name to fill in
# a markdown link to a page or picture of the checkout, relative to the page: [text](engine.md#anchor)
LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)")


def module_file(dotted: str) -> Path | None:
    """The source file of the module `dotted` names (a package's __init__.py), or None."""
    base = ROOT.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def defined_names(source: Path) -> dict[str, ast.AST]:
    """The names a module defines at its top level (functions, classes, assignments, imports), each with its node."""
    tree = ast.parse(source.read_text(encoding="utf-8"))
    return names_in(tree.body)


def names_in(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a block of statements binds: defs, classes, (annotated) assignments, imports, including those
    under if/try at that level."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            names.update(names_in(node.body + node.orelse + getattr(node, "finalbody", [])))
    return names


def stale_dotted(dotted: str) -> str | None:
    """Why `dotted` names nothing in the code today, or None when it resolves: the longest prefix that is a module,
    then each further piece a name defined there (a class's attribute for the piece after a class; in a module with
    a __getattr__, an attribute it has on import)."""
    pieces = dotted.split(".")
    for cut in range(len(pieces), 0, -1):
        source = module_file(".".join(pieces[:cut]))
        if source is not None:
            break
    else:
        return "no such module"
    rest = pieces[cut:]
    if not rest:
        return None
    module = ".".join(pieces[:cut])
    names = defined_names(source)
    if rest[0] not in names:
        if "__getattr__" in names:  # a lazy attribute (PEP 562, `jaxdp.Engine`): only importing can tell
            return None if hasattr(importlib.import_module(module), rest[0]) else f"{module} has no {rest[0]}"
        return f"{module} defines no {rest[0]}"
    node = names[rest[0]]
    for piece in rest[1:]:
        if not isinstance(node, ast.ClassDef):
            return None  # an attribute of a value: beyond what reading the source can say
        members = names_in(node.body)
        if piece not in members:
            return f"class {node.name} has no {piece}"
        node = members[piece]
    return None


def stale_path(path: str) -> str | None:
    """Why the checkout has no `path`, or None when it is a file or folder there."""
    return None if (ROOT / path.rstrip(".")).exists() else "no such file or folder"


def stale_repo_path(path: str) -> str | None:
    """Why the checkout has no file `path` (from a top folder, or inside the package without `jaxdp/`), or None
    when it has one or the path is not the checkout's (SGLang's `models/deepseek_v2.py`, a placeholder)."""
    top = path.split("/")[0]
    if path in PLACEHOLDERS or (top not in TOP_FOLDERS and top not in PACKAGE_FOLDERS):
        return None
    if top in TOP_FOLDERS and (ROOT / path).exists():
        return None
    if top in PACKAGE_FOLDERS and any((ROOT / "jaxdp").rglob(path)):
        return None
    return "no such file"


def references() -> list[tuple[str, str, str]]:
    """(page:line, kind, reference) for every dotted name, path and link the pages show (a path that is a file
    next to the page, `experiments/skew.png` in docs/, is the page's own and not checked again)."""
    found = []
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{n}"
            found += [(where, "dotted", m.group(0).rstrip(".")) for m in DOTTED.finditer(line)]
            found += [(where, "path", m.group(0).rstrip(".,:;")) for m in PATH.finditer(line)]
            found += [(where, "repo path", m.group(0)) for m in REPO_PATH.finditer(line)
                      if not m.group(0).startswith("jaxdp/") and not (page.parent / m.group(0)).exists()]
            found += [(where, "link", (page.parent / m.group(1)).resolve().relative_to(ROOT).as_posix())
                      for m in LINK.finditer(line)]
    return found


def stale_references() -> list[tuple[str, str, str]]:
    """(page:line, reference, why) for each reference that names nothing in the code today."""
    stale = []
    for where, kind, reference in references():
        check = {"dotted": stale_dotted, "path": stale_path, "repo path": stale_repo_path, "link": stale_path}[kind]
        why = check(reference)
        if why is not None:
            stale.append((where, reference, why))
    return stale


def test_the_pages_name_the_package():
    """The scan finds references at all (a broken pattern would pass every page)."""
    kinds = {kind for _, kind, _ in references()}
    assert kinds == {"dotted", "path", "repo path", "link"}


def test_the_check_sees_a_stale_reference():
    """A module that is gone, a name a module does not define and a missing path are each reported."""
    assert stale_dotted("jaxdp.backends") == "jaxdp has no backends"
    assert stale_dotted("jaxdp.Engine") is None
    assert stale_dotted("jaxdp.ops.registry.NO_SUCH_TABLE") == "jaxdp.ops.registry defines no NO_SUCH_TABLE"
    assert stale_dotted("jaxdp.ops.registry") is None
    assert stale_dotted("jaxdp.engine.loop") is None
    assert stale_path("jaxdp/engine/no_such_module.py") == "no such file or folder"
    assert stale_path("jaxdp/ops/") is None
    assert stale_repo_path("step/pipeline.py") is None
    assert stale_repo_path("api/no_such_module.py") == "no such file"
    assert stale_repo_path("tests/test_no_such_file.py") == "no such file"
    assert stale_repo_path("models/deepseek_v2.py") is None  # SGLang's, not the checkout's


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_reference_exists(page: str):
    """Each jaxdp module, name and path the page names exists in the code today."""
    stale = [f"{where}: {reference} ({why})" for where, reference, why in stale_references() if
             where.startswith(page + ":")]
    assert not stale, "stale references (rename them to what the code calls them today):\n" + "\n".join(stale)


if __name__ == "__main__":
    problems = stale_references()
    for where, reference, why in problems:
        print(f"{where}: {reference} ({why})")
    sys.exit(1 if problems else 0)
