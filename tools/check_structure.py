"""Structure checks of the product packages: long modules, long functions, import cycles.

Usage: ``python3 tools/check_structure.py [--max-module-lines 500] [--max-function-lines 120]``
from the repository root.  Scans the Python files of ``runtime/``, ``kernels/``, ``operator/``
and ``common/`` (the ``kiln.*`` source folders; folders that do not exist are skipped) and
prints three sections:

* modules over the line limit (physical lines);
* functions (and methods) over the line limit, from their ``def`` (decorators excluded) to
  their last line, except Triton kernels and helpers (decorated with ``triton.jit`` /
  ``triton.autotune`` / ``triton.heuristics``): those are exempt;
* import cycles among ``kiln.*`` modules: the static import graph (every ``import`` and
  ``from ... import`` in the file, at any depth, including those inside functions; relative
  imports resolved; ``from pkg import name`` counts as importing ``pkg.name`` when that is a
  module, else ``pkg``; a package's ``__init__`` is the module ``pkg``), strongly connected
  components by Tarjan's algorithm; every component with more than one module is a cycle.
  Imports under ``if TYPE_CHECKING:`` are left out (they never run).

Exit status 0 always (a report, not a gate); ``--strict`` exits 1 when any section is non-empty.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOTS = ("runtime", "kernels", "operator", "common")
JIT_DECORATORS = {"jit", "autotune", "heuristics"}


def module_files(repo: Path) -> dict[str, Path]:
    """``{"kiln.x.y": path}`` for every ``kiln/**/*.py`` under the source roots."""
    out: dict[str, Path] = {}
    for root in ROOTS:
        base = repo / root
        if not (base / "kiln").is_dir():
            continue
        for path in sorted((base / "kiln").rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_jit(node: ast.AST) -> bool:
    for dec in getattr(node, "decorator_list", []):
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in JIT_DECORATORS:
            return True
    return False


def long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of non-Triton functions longer than ``limit``."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                length = child.end_lineno - child.lineno + 1
                if length > limit and not _is_jit(child):
                    found.append((name, child.lineno, length))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(module: str, path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    """The ``kiln.*`` modules ``module`` imports (see the module doc for the rules)."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("kiln."):
                        target = resolve(alias.name)
                        if target:
                            out.add(target)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)] if child.level > 1 else base
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if not mod.startswith("kiln"):
                    continue
                for alias in child.names:
                    target = resolve(f"{mod}.{alias.name}") if f"{mod}.{alias.name}" in known else resolve(mod)
                    if target:
                        out.add(target)
            visit(child)

    visit(tree)
    out.discard(module)
    return out


def tarjan(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of ``graph`` (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                comps.append(sorted(comp))
    return comps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--max-module-lines", type=int, default=500)
    ap.add_argument("--max-function-lines", type=int, default=120)
    ap.add_argument("--strict", action="store_true", help="exit 1 when anything is reported")
    a = ap.parse_args(argv)
    repo = Path(a.repo)
    files = module_files(repo)
    known = set(files)
    graph: dict[str, set[str]] = {}
    big_modules, big_functions = [], []
    for module, path in files.items():
        text = path.read_text()
        tree = ast.parse(text, filename=str(path))
        n = len(text.splitlines())
        rel = path.relative_to(repo)
        if n > a.max_module_lines:
            big_modules.append(f"{rel}: {n} lines")
        for name, line, length in long_functions(tree, a.max_function_lines):
            big_functions.append(f"{rel}:{line} {name}: {length} lines")
        graph[module] = imports(module, path, tree, known)
    cycles = [c for c in tarjan(graph) if len(c) > 1]
    print(f"== modules over {a.max_module_lines} lines ({len(big_modules)})")
    print("\n".join(big_modules) or "none")
    print(f"== functions over {a.max_function_lines} lines, Triton kernels exempt ({len(big_functions)})")
    print("\n".join(big_functions) or "none")
    print(f"== import cycles among kiln.* modules ({len(cycles)}; {len(graph)} modules scanned)")
    print("\n".join(" <-> ".join(c) for c in cycles) or "none")
    return 1 if a.strict and (big_modules or big_functions or cycles) else 0


if __name__ == "__main__":
    sys.exit(main())
