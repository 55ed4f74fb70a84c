"""The import graph of the packages: no cycles (function-level imports included), and imports at module top
except at the seams that keep a heavy dependency off a path that must start without it."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("decoder", "kernels", "costmodel", "store", "workbench")
# A function-level import is a seam only where the imported module pulls one of these in (at its top or
# through its own top-level imports): the CLIs, the headless loop and the cost model start without them.
HEAVY = ("torch", "transformers", "textual", "openai", "triton", "matplotlib", "safetensors", "tokenizers", "ray",
         "gguf")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache  # the sources do not change during a run; each test walks every module
def _imports(mod: str) -> tuple[tuple[str, bool, int], ...]:
    """(imported name, inside a function, line) for every import in module `mod`, relative ones resolved."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    inner = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out += [(n, id(node) in inner, node.lineno) for n in names]
    return tuple(out)


def _graph(function_level: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for name, inner, _ in _imports(m):
            if inner and not function_level:
                continue
            target = _resolve(name) if name.split(".")[0] in PACKAGES else None
            if target and target != m:
                graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _heavy_closure() -> dict[str, set[str]]:
    """Per module: the heavy packages it pulls in through module-level imports, transitively."""
    direct = {m: {n.split(".")[0] for n, inner, _ in _imports(m) if not inner and n.split(".")[0] in HEAVY}
              for m in MODULES}
    graph = _graph(function_level=False)
    memo: dict[str, set[str]] = {}

    def heavy(m: str, seen: frozenset = frozenset()) -> set[str]:
        if m in memo:
            return memo[m]
        out = set(direct[m])
        for t in graph[m]:
            if t not in seen:
                out |= heavy(t, seen | {m})
        for parent in _parents(m):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            out |= heavy(parent, seen | {m})
        memo[m] = out
        return out

    return {m: heavy(m) for m in MODULES}


def _parents(mod: str) -> list[str]:
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]


def test_the_graph_walker_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_function_level_imports_included():
    assert _cycles(_graph(function_level=True)) == []


def test_function_level_imports_only_at_the_heavy_seams():
    """An import inside a function is allowed where it keeps a heavy dependency (torch, Textual, ...) off a
    path that starts without it; any other belongs at the top of the module, where a reader sees the arrow."""
    heavy = _heavy_closure()
    bad = set()
    for m in MODULES:
        for name, inner, line in _imports(m):
            top = name.split(".")[0]
            if not inner or top in HEAVY:
                continue
            target = _resolve(name) if top in PACKAGES else None
            if target is not None and heavy[target]:
                continue  # a seam: the module pulls in a heavy dependency
            bad.add(f"{MODULES[m].relative_to(ROOT)}:{line} imports {target or name} inside a function")
    assert not bad, "\n".join(sorted(bad))


def test_the_command_lines_start_without_torch():
    """`specpilot` and `specpilot-tui --auto` answer a usage error in well under a second: neither imports
    torch (or transformers) at module level; the engine loads where a command needs it."""
    heavy = _heavy_closure()
    for entry in ("workbench.cli", "workbench.tui_entry", "workbench.workspace", "decoder.capabilities"):
        assert not heavy[entry] & {"torch", "transformers"}, (entry, heavy[entry])
