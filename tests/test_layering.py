"""The package's layers (docs/architecture.md): each folder imports only from the layers below it,
no two modules import each other (directly or round a cycle), and the package root stays small.

Imports are read from the source, every one of them: at module level, inside functions and under
TYPE_CHECKING (a lazy import is still a dependency)."""
from __future__ import annotations

import ast
from pathlib import Path

import wallbreaker

ROOT = Path(wallbreaker.__file__).parent
PACKAGE = ROOT.name

# Lower imports from higher, never the other way; one level may not import another of the same level.
LAYERS = {
    "_C": 0, "errors": 0,
    "config": 1, "sampling_params": 1,
    "text": 2,
    "formats": 3, "pooling_params": 3,
    "kernels": 4,
    "layers": 5,
    "models": 6, "kv": 6, "vision": 6, "lora": 6,
    "engine": 7,
    "spec_decode": 8, "parallel": 8, "pooling_requests": 8,
    "llm": 9,
    "quant": 10, "server": 10,
    "measure": 11,
    "cli": 12, "__init__": 12,
}
# Known exceptions to the rule (none now), each to be listed with the change that removes it.
EXCEPTIONS: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of one of the package's modules."""
    known = set(mods) | {f"{PACKAGE}._C"}
    edges = set()
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != PACKAGE:
                    continue
                while target not in known:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    edges.add((name, target))
    return edges


def unit(module: str) -> str:
    """The folder a module is in, or the root module it is."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_folder_imports_only_from_the_layers_below_it():
    mods = modules()
    assert {unit(m) for m in mods} <= set(LAYERS), "a new folder or root module: give it a layer"
    wrong = sorted((a, b) for a, b in imports(mods) - EXCEPTIONS
                   if unit(a) != unit(b) and b != PACKAGE and LAYERS[unit(b)] >= LAYERS[unit(a)])
    assert not wrong, wrong


def test_no_module_imports_itself_round_a_cycle():
    graph: dict[str, set[str]] = {}
    for a, b in imports(modules()):
        if b != PACKAGE:  # `from .. import _C` loads the package first; that is no dependency on it
            graph.setdefault(a, set()).add(b)
    done, path, cycles = set(), [], []

    def visit(node: str) -> None:
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        path.pop()
        done.add(node)
    for node in sorted(graph):
        visit(node)
    assert not cycles, cycles


def test_the_package_root_holds_at_most_eight_modules():
    root_modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root_modules) <= 8, root_modules


def test_the_server_reaches_the_engine_only_through_its_door():
    """server/ imports from engine/ only engine/client.py (its types included): handlers never hold
    the engine's insides."""
    reached = sorted({b for a, b in imports(modules()) if unit(a) == "server" and unit(b) == "engine"})
    assert reached == [f"{PACKAGE}.engine.client"], reached
