"""The house rules a newcomer relies on: no import circle among kvq's modules, no module over 500 lines but the
kernel sources, and the kernels reached only through kvq.ops."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvq"
MAX_LINES = 500
KERNELS = "kvq.kernels"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, known: set[str]) -> set[str]:
    """The kvq modules a source imports when it is imported (not those imported inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known}


def _all_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_no_import_circle_among_kvq_modules():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _top_level_imports(path, set(modules)) - {name} for name, path in modules.items()}
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                circles.append([*trail[trail.index(imported):], imported])
            elif imported not in state:
                visit(imported, [*trail, imported])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, [" -> ".join(circle) for circle in circles]


def test_no_module_is_over_500_lines():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {path: n for path, n in lines.items() if n > MAX_LINES}


def test_kernel_modules_are_imported_only_by_kvq_ops_and_the_kernels():
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]
    callers = [p for p in sources if p != PACKAGE / "ops.py" and not p.is_relative_to(PACKAGE / "kernels")]
    leaks = {str(p.relative_to(ROOT)): sorted(name for name in _all_imports(p) if name.startswith(KERNELS))
             for p in callers}
    assert not {path: names for path, names in leaks.items() if names}
