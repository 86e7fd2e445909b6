"""The floor plan, enforced: which package may import which (docs/architecture.md).

Imports are read from the source with :mod:`ast`. Only module-level imports count: one
inside a function, or under ``if TYPE_CHECKING:``, is lazy (it runs where a model actually
runs, or never) and is allowed. Importing a module also runs its parent packages'
``__init__``, so those count for what a module pulls in, not for cycles (a package and its
submodules always refer to each other).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("embgeom", "service", "benchmarks", "tests")
# What tests and benchmarks share (embgeom/testing/): the product never imports it.
TESTING = "embgeom.testing"
# Tests that test the benchmarks themselves, and may import them. test_store pins the drift
# that benchmarks/aggregates.py measures with that module's harness, which stays there:
# ``--against`` runs it on another checkout's embgeom, one that may have no embgeom.testing.
# test_docs checks the tables benchmarks/docs_tables.py writes into the docs.
BENCHMARK_TESTS = ("tests.test_benchmarks", "tests.test_docs", "tests.test_soak", "tests.test_steady_state",
                   "tests.test_store")
HEAVY = ("torch", "transformers", "redis")
# numpy only: the quantities and their formulas, no I/O (embgeom.comparisons reads the
# store for the geometry measures, a layer above).
MATH = ("embgeom.stats", "embgeom.diagnostics", "embgeom.keyspace", "embgeom.geometry")
# What the math never imports, even lazily: the layers that read, run models or serve.
IO_LAYERS = ("embgeom.store", "embgeom.compute", "embgeom.comparisons", "embgeom.worker", "service")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """The project's modules, by dotted name."""
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, lazy_too: bool):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not lazy_too and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif not lazy_too and isinstance(child, ast.If) and _is_type_checking(child.test):
            for orelse in child.orelse:
                yield from _import_nodes(ast.Module(body=[orelse], type_ignores=[]), lazy_too)
        else:
            yield from _import_nodes(child, lazy_too)


@lru_cache(maxsize=None)
def imports(module: str, lazy_too: bool = False) -> frozenset[str]:
    """The modules ``module`` imports by name: at module level, or anywhere with ``lazy_too``.
    ``from a import b`` names ``a.b`` when that is a module of the project, else ``a``."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), lazy_too):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from the package, up level - 1
            anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            out.add(sub if sub in modules() else base)
    return frozenset(out)


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@lru_cache(maxsize=None)
def pulled_in(module: str) -> frozenset[str]:
    """Every module importing ``module`` runs at module level, its parent packages' included,
    third-party ones by their top-level name."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        for name in imports(current):
            for step in _with_parents(name):
                if step in modules():
                    if step not in seen:
                        seen.add(step)
                        todo.append(step)
                else:
                    seen.add(step.split(".")[0])
    return frozenset(seen)


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_math_modules_pull_in_no_torch_redis_or_transformers():
    math = [m for m in modules() if any(in_package(m, p) for p in MATH)]
    assert "embgeom.stats" in math and "embgeom.geometry.similarity" in math
    wrong = {m: sorted(pulled_in(m) & set(HEAVY)) for m in math if pulled_in(m) & set(HEAVY)}
    assert not wrong, wrong


def test_the_geometry_math_imports_no_store_compute_or_service_even_lazily():
    geometry = [m for m in modules() if in_package(m, "embgeom.geometry")]
    assert "embgeom.geometry" in geometry and "embgeom.geometry.matching" in geometry
    wrong = {}
    for m in geometry:
        names = pulled_in(m) | imports(m, lazy_too=True)
        bad = sorted(i for i in names if i.split(".")[0] in HEAVY
                     or any(in_package(i, layer) for layer in IO_LAYERS))
        if bad:
            wrong[m] = bad
    assert not wrong, wrong


def test_the_geometry_math_imports_with_torch_and_redis_absent():
    # None in sys.modules makes an import of that name fail, as if it were not installed.
    geometry = sorted(m for m in modules() if in_package(m, "embgeom.geometry"))
    code = ("import sys; sys.modules.update(dict.fromkeys(['torch', 'redis', 'transformers'])); "
            f"import importlib; [importlib.import_module(m) for m in {geometry!r}]; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_service_never_imports_the_worker_even_lazily():
    # Embedded workers are processes (python -m embgeom.cli worker); the service reads their
    # heartbeats from the store (embgeom.store.heartbeats).
    service = [m for m in modules() if in_package(m, "service")]
    wrong = [m for m in service if any(in_package(i, "embgeom.worker") for i in imports(m, lazy_too=True))]
    assert not wrong, wrong
    wrong = [m for m in service if "embgeom.worker" in pulled_in(m)]
    assert not wrong, wrong


def _importing(modules_: list[str], packages: tuple[str, ...]) -> dict[str, list[str]]:
    """Module -> what it imports (lazily too) from ``packages``, where it imports any."""
    wrong = {m: sorted(i for i in imports(m, lazy_too=True) if any(in_package(i, p) for p in packages))
             for m in modules_}
    return {m: names for m, names in wrong.items() if names}


def test_the_shared_test_helpers_import_neither_tests_nor_benchmarks():
    testing = [m for m in modules() if in_package(m, TESTING)]
    assert f"{TESTING}.serve" in testing and f"{TESTING}.reference" in testing
    wrong = _importing(testing, ("tests", "benchmarks"))
    assert not wrong, wrong


def test_the_benchmarks_import_no_test_module():
    benchmarks = [m for m in modules() if in_package(m, "benchmarks")]
    assert "benchmarks.soak.harness" in benchmarks
    wrong = _importing(benchmarks, ("tests",))
    assert not wrong, wrong


def test_only_the_benchmarks_own_tests_import_the_benchmarks():
    tests = [m for m in modules() if in_package(m, "tests") and m not in BENCHMARK_TESTS]
    wrong = _importing(tests, ("benchmarks",))
    assert not wrong, wrong


def test_the_product_does_not_import_the_test_helpers():
    product = [m for m in modules() if (in_package(m, "embgeom") and not in_package(m, TESTING))
               or in_package(m, "service")]
    wrong = _importing(product, (TESTING,))
    assert not wrong, wrong


def test_the_library_does_not_import_the_service():
    # The one exception is lazy: `embgeom serve` imports service.app inside its command.
    wrong = {m: sorted(i for i in imports(m) if in_package(i, "service"))
             for m in modules() if in_package(m, "embgeom")}
    wrong = {m: names for m, names in wrong.items() if names}
    assert not wrong, wrong


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    out.append(sorted(component))
    return out


def test_cycles_finds_a_circle_and_nothing_else():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    graph = {m: {i for i in imports(m) if i in modules() and i != m} for m in modules()}
    assert not _cycles(graph), _cycles(graph)


def test_importing_the_app_leaves_torch_transformers_the_worker_and_the_test_helpers_out():
    heavy = ["torch", "transformers", "embgeom.worker", "embgeom.compute.models", TESTING]
    code = ("import sys, service.app; "
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "", f"importing service.app imported {out}"


def test_no_class_of_the_product_is_over_300_lines():
    """A class that long holds several concerns: split it along a seam (issue 29's rule)."""
    import ast

    long = {}
    for package in ("embgeom", "service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                    long[f"{path.relative_to(ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long
