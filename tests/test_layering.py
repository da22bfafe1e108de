"""The house's layering, read from the import graph (every import, including
those inside functions): imports point one way, down the layers (those under
``if TYPE_CHECKING:``, which only annotate, aside), and no two modules import
each other, directly or through others (annotation imports included: a cycle
that only annotations close is still two modules that need each other)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top.  A module may import modules of its own package or of a lower
# layer; packages that share a layer do not import each other.
LAYERS = (
    ("conformance.errors", "conformance.inputs"),
    ("conformance.contract",),
    ("conformance.model",),
    ("conformance.disagg",),  # the two-worker contract: layouts, geometry, descriptors
    ("conformance.adapters",),
    ("conformance.harness",),
    ("conformance.judge",),
    ("conformance.generate",),
    ("fault_injection", "conformance.results"),
    # Whole engines (the engine level): the suite prepares and executes their runs as it does the cache level's.
    ("conformance.engine",),
    ("conformance.suite", "conformance.analysis"),
    ("conformance.cli", "conformance.pytest_plugin", "conformance.testing"),
    ("conformance.__main__", "conformance"),  # entry points
)


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("conformance", "fault_injection"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _imports(name: str, path: Path, known: set[str], annotations: bool = False) -> set[str]:
    is_pkg = path.name == "__init__.py"
    out = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop annotation-only imports before walking (unless asked for)
        if not annotations and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _layer(module: str) -> tuple[int, str]:
    best = None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if module == prefix or (prefix != "conformance" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (i, prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def graph(annotations: bool = False) -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known, annotations) for m, p in mods.items()}


def test_every_module_has_a_layer():
    for module in graph():
        _layer(module)


def test_imports_point_down():
    wrong = []
    for module, deps in graph().items():
        lm, pm = _layer(module)
        for dep in deps:
            ld, pd = _layer(dep)
            if dep == "conformance" and module != "conformance":
                wrong.append(f"{module} imports the package root")
            elif ld > lm or (ld == lm and pd != pm):
                wrong.append(f"{module} (layer {lm}, {pm}) imports {dep} (layer {ld}, {pd})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles():
    g = graph(annotations=True)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)
