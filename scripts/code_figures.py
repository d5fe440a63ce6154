"""Prints the layout figures of services/: sizes, modules per folder, long modules, cycles."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import check_imports  # noqa: E402  (a sibling script, found through the line above)

ROOT = Path(__file__).resolve().parent.parent
LONG_MODULE_LINES = 300  # docs/architecture.md, Style 1: modules stay under ~300 lines ...
MAX_MODULE_LINES = 400  # ... and none, allowlisted or not, grows past this
LONG_FUNCTION_LINES = 50  # ... functions under ~50

# Modules allowed over LONG_MODULE_LINES: path -> one-line reason. Keep it short.
LONG_MODULES: dict[str, str] = {
    "services/engine/engine.py": "the Engine class read whole (its API and step); engine/ is next",
    "services/router/openai/app.py": "the ASGI app: its route table and handlers, read whole",
    "services/common/metrics.py": "the catalogue of every exported metric, one definition each",
    "services/config/roles.py": "every role's config; each field's docstring is its flag's help",
}


@dataclass(frozen=True)
class Function:
    """One function or method: where it starts and how many lines (def to last line) it has."""

    path: str
    line: int
    name: str  # qualified: Class.method, outer.inner
    lines: int


@dataclass(frozen=True)
class Cycle:
    """An import cycle as a chain of modules (first == last); `type_only` marks each edge
    (chain[i] -> chain[i + 1]) made only of imports under `if TYPE_CHECKING:`."""

    chain: tuple[str, ...]
    type_only: tuple[bool, ...]

    def __str__(self) -> str:
        out = self.chain[0]
        for module, type_only in zip(self.chain[1:], self.type_only, strict=True):
            out += f" {'-(type)->' if type_only else '->'} {module}"
        return out


def source_files(root: Path) -> list[Path]:
    """Every .py file of services/ but the generated services/common/pb/."""
    return [p for p in check_imports.python_files(root) if not check_imports.is_generated(root, p)]


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def module_lines(root: Path) -> dict[str, int]:
    """path -> number of lines, for every source file."""
    return {
        _rel(root, p): len(p.read_text(encoding="utf-8").splitlines()) for p in source_files(root)
    }


def modules_per_folder(root: Path) -> dict[str, list[str]]:
    """folder -> its modules (the non-`__init__` .py files directly in it), every folder listed."""
    out: dict[str, list[str]] = {}
    for path in source_files(root):
        names = out.setdefault(_rel(root, path.parent), [])
        if path.name != "__init__.py":
            names.append(path.stem)
    return dict(sorted(out.items()))


def long_modules(root: Path, limit: int = LONG_MODULE_LINES) -> dict[str, int]:
    """path -> lines, for the modules over `limit` lines, longest first."""
    lines = module_lines(root)
    return dict(sorted(((p, n) for p, n in lines.items() if n > limit), key=lambda x: -x[1]))


def _functions_in(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions_in(child, name + ".")
        else:
            yield from _functions_in(child, prefix)


def functions(root: Path) -> list[Function]:
    """Every function and method (nested ones too), longest first."""
    out = []
    for path in source_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name, node in _functions_in(tree, ""):
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            out.append(Function(_rel(root, path), node.lineno, name, lines))
    return sorted(out, key=lambda f: (-f.lines, f.path, f.line))


def import_graph(root: Path) -> dict[str, dict[str, bool]]:
    """module -> {imported module of ours: type-only?}, from module-level imports and imports
    under `if TYPE_CHECKING:` (function-level imports run later, so they make no cycle)."""
    imports, known = check_imports.scan(root)
    graph: dict[str, dict[str, bool]] = {}
    for records in imports.values():
        for record in records:
            edges = graph.setdefault(record.importer, {})
            if record.level == check_imports.FUNCTION_LEVEL:
                continue
            type_only = record.level == check_imports.TYPE_CHECKING_LEVEL
            for name in check_imports.imported_modules(record, known):
                if name in known and name != record.importer:
                    edges[name] = edges.get(name, True) and type_only
    return graph


def _strongly_connected(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
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
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def import_cycles(root: Path, limit: int = 50) -> list[Cycle]:
    """The elementary import cycles between modules of services (at most `limit`), each
    starting at its smallest module."""
    graph = import_graph(root)
    cycles: list[Cycle] = []
    for component in _strongly_connected(graph):
        members = set(component)
        for start in component:  # cycles through `start` and modules after it only
            allowed = {m for m in members if m >= start}
            paths = [[start]]
            while paths and len(cycles) < limit:
                path = paths.pop()
                for child in sorted(graph.get(path[-1], {}), reverse=True):
                    if child == start:
                        chain = (*path, start)
                        flags = tuple(graph[a][b] for a, b in zip(chain, chain[1:], strict=False))
                        cycles.append(Cycle(chain, flags))
                    elif child in allowed and child not in path:
                        paths.append([*path, child])
    return sorted(cycles, key=lambda c: c.chain)


def figures(root: Path = ROOT, boundaries: bool = True, runtime: bool = True) -> dict:
    """Every figure, as plain data (what `--json` prints)."""
    lines = module_lines(root)
    folders = modules_per_folder(root)
    over = long_modules(root)
    funcs = functions(root)
    out: dict = {
        "files": len(lines),
        "lines": sum(lines.values()),
        "modules_per_folder": {
            folder: {"modules": len(names), "lines": _folder_lines(lines, folder)}
            for folder, names in folders.items()
        },
        "modules_over_300": {
            path: {"lines": n, "reason": LONG_MODULES.get(path)} for path, n in over.items()
        },
        "modules_over_300_without_reason": [p for p in over if p not in LONG_MODULES],
        "modules_over_400": {p: n for p, n in over.items() if n > MAX_MODULE_LINES},
        "largest_function": asdict(funcs[0]) if funcs else None,
        "functions_over_50": [asdict(f) for f in funcs if f.lines > LONG_FUNCTION_LINES],
        "import_cycles": [
            {"chain": list(c.chain), "type_only": list(c.type_only), "text": str(c)}
            for c in import_cycles(root)
        ],
        "import_boundaries": None,
    }
    if boundaries:
        report = check_imports.run_checks(root, runtime=runtime)
        out["import_boundaries"] = {
            "ok": not report.violations,
            "violations": [str(v) for v in report.violations],
            "runtime": runtime,
            "files": report.num_files,
            "modules_imported": report.num_runtime_modules,
            "skipped": report.skipped,
            "stale_pb_importers": report.stale_pb_importers,
            "seconds": round(report.seconds, 1),
        }
    return out


def _folder_lines(lines: dict[str, int], folder: str) -> int:
    return sum(n for path, n in lines.items() if path.rpartition("/")[0] == folder)


def _table(
    rows: Sequence[Sequence[str]],
    header: Sequence[str] | None = None,
    right: tuple[int, ...] = (),
) -> list[str]:
    """Plain-text columns, left-aligned but for the `right` ones (numbers)."""
    all_rows = [*([header] if header else []), *rows]
    widths = [max(len(row[i]) for row in all_rows) for i in range(len(all_rows[0]))]
    out = []
    for row in all_rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


def render(fig: dict) -> str:
    """The figures as a few small plain-text tables."""
    over, over400 = fig["modules_over_300"], fig["modules_over_400"]
    largest = fig["largest_function"]
    bounds = fig["import_boundaries"]
    if bounds is None:
        bounds_text = "not checked"
    elif bounds["ok"]:
        how = "static + runtime" if bounds["runtime"] else "static only"
        bounds_text = f"OK ({how}, {bounds['seconds']} s)"
    else:
        bounds_text = f"{len(bounds['violations'])} violation(s)"
    no_reason = len(fig["modules_over_300_without_reason"])
    summary = [
        ("files", str(fig["files"])),
        ("lines", f"{fig['lines']:,}"),
        (f"modules over {LONG_MODULE_LINES} lines", f"{len(over)} ({no_reason} without a reason)"),
        (f"modules over {MAX_MODULE_LINES} lines", str(len(over400))),
        (
            "largest function",
            f"{largest['name']} ({largest['lines']} lines) {largest['path']}:{largest['line']}"
            if largest
            else "-",
        ),
        (f"functions over {LONG_FUNCTION_LINES} lines", str(len(fig["functions_over_50"]))),
        ("import cycles (incl. type-only)", str(len(fig["import_cycles"]))),
        ("import boundaries", bounds_text),
    ]
    out = ["services/ (without the generated services/common/pb/)"]
    out += _table(summary)
    out += ["", "Modules per folder"]
    out += _table(
        [
            (folder, str(v["modules"]), f"{v['lines']:,}")
            for folder, v in fig["modules_per_folder"].items()
        ],
        ("folder", "modules", "lines"),
        right=(1, 2),
    )
    if over:
        out += ["", f"Modules over {LONG_MODULE_LINES} lines"]
        out += _table(
            [
                (p, str(v["lines"]), v["reason"] or "NO REASON (add one to LONG_MODULES)")
                for p, v in over.items()
            ],
            right=(1,),
        )
    if fig["import_cycles"]:
        out += ["", "Import cycles (-(type)-> : only under `if TYPE_CHECKING:`)"]
        out += [f"  {c['text']}" for c in fig["import_cycles"]]
    if bounds and (bounds["violations"] or bounds["stale_pb_importers"] or bounds["skipped"]):
        out += ["", "Import boundaries"]
        out += [f"  {v}" for v in bounds["violations"]]
        out += [f"  note: {m} no longer imports protobuf" for m in bounds["stale_pb_importers"]]
        out += [
            f"  note: {m} checked statically only ({why})" for m, why in bounds["skipped"].items()
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root", nargs="?", type=Path, default=ROOT)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--static-only", action="store_true", help="check import boundaries statically only"
    )
    args = parser.parse_args(argv)
    fig = figures(args.root, runtime=not args.static_only)
    print(json.dumps(fig, indent=2) if args.json else render(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
