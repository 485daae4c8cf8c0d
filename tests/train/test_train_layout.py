"""train/'s layout keeps its promises (docs/architecture.md): packages import only downward, no import
circle exists (imports inside functions count), the trainer names no objective, modules stay small,
and the dependency direction datapipe → storage ← train holds."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from testutil import REPO

# lowest first; a module may import its own package and those before it
LAYERS = ["model", "monitor", "checkpoint", "generation", "eval", "objectives", None]  # None: top level
SHARED = {"train.state", "train.config"}  # importable from anywhere


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str:
    """`from train.model import parallel` names train.model.parallel when that is a module."""
    return name if name in modules else name.rsplit(".", 1)[0]


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every module `path` imports, at any depth (functions included), outside `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {_resolve(f"{node.module}.{a.name}", modules) for a in node.names}
    return out


def _graph(package: str) -> dict[str, set[str]]:
    files = sorted((REPO / package).rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def _layer(module: str) -> int:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None
    return LAYERS.index(sub)


def test_packages_import_only_downward():
    graph = _graph("train")
    wrong = []
    for mod, deps in graph.items():
        for dep in deps:
            if dep.split(".")[0] == "datapipe":
                wrong.append(f"{mod} imports {dep} (train may not import datapipe)")
            elif dep.startswith("train.") and dep not in SHARED and dep != "train" and _layer(dep) > _layer(mod):
                wrong.append(f"{mod} imports {dep}")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))
    storage = _graph("storage")
    assert not [(m, d) for m, ds in storage.items() for d in ds if d.split(".")[0] in ("train", "datapipe")]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in graph:
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    graph = {**_graph("train"), **_graph("storage"), **_graph("datapipe")}
    # a package's __init__ re-exporting its submodules is not a circle of the submodules themselves
    graph = {m: {d for d in ds if not (m.startswith(d + ".") and d in graph)} for m, ds in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # the check sees circles through function-level imports (the one config.py <-> models.py had)
    assert _cycle({**graph, "train.model.gpt": graph["train.model.gpt"] | {"train.config"}}) is not None


def test_trainer_names_no_objective_and_modules_stay_small():
    text = (REPO / "train" / "trainer.py").read_text()
    assert not [ln for ln in text.splitlines() if re.search(r"dpo|objective ==|objective !=", ln)]
    big = {str(p.relative_to(REPO)): n for p in (REPO / "train").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 400}
    assert not big, big


def test_every_package_says_what_it_holds_and_may_import():
    for init in (REPO / "train").rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc) > 80, f"{init}: no package docstring"
        if init.parent.name in LAYERS:
            assert "May import" in doc, f"{init}: the docstring does not say what the package may import"
