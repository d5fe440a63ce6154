"""Checks pdserve's import boundaries, statically (every import in the AST) and at runtime."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# The rules' data (docs/architecture.md, "Import boundaries"). Edit these, not the code below.
# ---------------------------------------------------------------------------------------------

# Rule 1: what the engine (services/engine/**) may not load.
ENGINE_FORBIDDEN_PACKAGES = (
    "grpc",
    "grpc_health",  # gRPC's add-ons load grpc
    "grpc_reflection",
    "ray",
    "prometheus_client",
    "uvicorn",
    "starlette",
    "httptools",
    "aiohttp",
    "redis",
)
ENGINE_FORBIDDEN_SERVICES = tuple(
    f"services.{name}"
    for name in (
        "common",
        "router",
        "prefill",
        "decode",
        "cluster",
        "cli",
        "worker",
        "config",
        "prefix_index",
        "ray_serve",
        "bench",
    )
)
# Of services.kv_transfer the engine may load only its transport-free modules.
ENGINE_KV_TRANSFER_ALLOWED = (
    "services.kv_transfer",
    "services.kv_transfer.base",
    "services.kv_transfer.handle",
    "services.kv_transfer.handshake",
    "services.kv_transfer.lease",
    "services.kv_transfer.sender",
    "services.kv_transfer.in_memory",
)

# Rule 2: what the router (services/router/**) and the CLI and client (services/cli/**) may not
# load.
NO_TORCH = ("torch", "transformers.modeling_utils")

# Rule 4: the generated protobuf modules, and the only modules that may import them.
PB_PACKAGE = "services.common.pb"
PB_IMPORTERS: dict[str, str] = {
    "services.bench.backends": "the gRPC benchmark backend is a client of the public Generate API",
    "services.cli.client": "the client: `pdserve generate` / `reset-prefix-cache` over gRPC",
    "services.cli.status": "`pdserve status` is a client of the router's Admin service",
    "services.common.channels": "the typed stubs of the internal RPCs (ReleaseKV, health)",
    "services.common.convert": "the one module that converts protobuf <-> engine dataclasses",
    "services.decode.server": "the decode worker's servicer",
    "services.prefill.server": "the prefill worker's servicer",
    "services.kv_transfer.control.paths": "the KV control plane: opening the chosen data path",
    "services.kv_transfer.control.lease_renewal": "the KV control plane: RenewKVLease client",
    "services.kv_transfer.control.pulls": "the KV control plane: the source's checks of a pull",
    "services.kv_transfer.control.receiver": "the KV control plane: the destination's client",
    "services.kv_transfer.control.service": "the KV control plane: the KVTransfer servicer",
    "services.kv_transfer.grpc.receiver": "the gRPC data path: PullKV client",
    "services.kv_transfer.grpc.wire": "the gRPC data path: KVChunk on the wire without copies",
    "services.kv_transfer.shared_memory.receiver": "the shared-memory path's ConfirmKVCopy RPC",
    "services.kv_transfer.torch_dist.receiver": "the torch.distributed path's SendKV RPC",
    "services.kv_transfer.torch_dist.source": "the torch.distributed path's OpenKVGroup/SendKV",
    "services.router.admin": "the router's Admin servicer",
    "services.router.convert": "the Generation servicer's messages <-> the flow's dataclasses",
    "services.router.server": "the router's Generation servicer",
    "services.router.pool.worker_pool": "the router's worker-client module (stubs, GetInfo)",
    "services.router.pool.worker_calls": "the router's worker-client module: Prefill/Decode RPCs",
    "services.worker.runtime": "the workers' Admin servicer and WorkerInfo",
}

# ---------------------------------------------------------------------------------------------

PACKAGE = "services"
RUNTIME = "runtime"  # Violation.where of what the runtime check found
MODULE_LEVEL, TYPE_CHECKING_LEVEL, FUNCTION_LEVEL = "module", "type-checking", "function"
_MARKER = "@@check_imports@@ "
_IMPORT_FAILED = "import failed"
_SUBPROCESS_TIMEOUT_S = 300


@dataclass(frozen=True, order=True)
class Violation:
    """One import that breaks a rule: `what` is the module imported (static, `where` is
    file:line) or loaded (runtime, `where` is "runtime")."""

    rule: str
    module: str
    what: str
    where: str

    def __str__(self) -> str:
        if self.what.startswith(_IMPORT_FAILED):
            return f"[{self.rule}] {self.where}: {self.module}: {self.what}"
        verb = "loads" if self.where == RUNTIME else "imports"
        return f"[{self.rule}] {self.where}: {self.module} {verb} {self.what}"


@dataclass(frozen=True)
class ImportRecord:
    """One import statement or literal `importlib.import_module`/`__import__` call."""

    importer: str  # the importing module, e.g. "services.router.flow.run"
    target: str  # absolute module name as written (relative imports resolved)
    names: tuple[str, ...]  # `from target import names` (empty for `import target`)
    line: int
    level: str  # MODULE_LEVEL, TYPE_CHECKING_LEVEL or FUNCTION_LEVEL


@dataclass(frozen=True)
class Rule:
    """A boundary: the modules of `folders` may not import/load what `forbids(importer, name)`
    says. At runtime the modules of each of `runtime_groups` (folders) are imported together,
    each group in its own process (prefill's from decode's); none for a static-only rule."""

    name: str
    folders: tuple[str, ...]
    forbids: Callable[[str, str], bool]
    runtime_groups: tuple[tuple[str, ...], ...] = ()


@dataclass
class Report:
    """What `run_checks` found; `check` returns its violations."""

    violations: list[Violation] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # module -> why (runtime only)
    num_files: int = 0
    num_runtime_modules: int = 0
    stale_pb_importers: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _engine_forbids(importer: str, name: str) -> bool:
    if any(_under(name, p) for p in ENGINE_FORBIDDEN_PACKAGES + ENGINE_FORBIDDEN_SERVICES):
        return True
    return _under(name, "services.kv_transfer") and name not in ENGINE_KV_TRANSFER_ALLOWED


def _torch_forbids(importer: str, name: str) -> bool:
    return any(_under(name, p) for p in NO_TORCH)


def _prefill_decode_forbids(importer: str, name: str) -> bool:
    if _under(importer, "services.prefill"):
        return _under(name, "services.decode")
    return _under(importer, "services.decode") and _under(name, "services.prefill")


def _pb_forbids(importer: str, name: str) -> bool:
    return (
        _under(name, PB_PACKAGE)
        and not _under(importer, PB_PACKAGE)
        and importer not in PB_IMPORTERS
    )


RULES = (
    Rule(
        "engine-no-transport",
        ("services/engine",),
        _engine_forbids,
        (("services/engine",),),
    ),
    Rule(
        "router-cli-no-torch",
        ("services/router", "services/cli"),
        _torch_forbids,
        (("services/router", "services/cli"),),
    ),
    Rule(
        "prefill-decode-apart",
        ("services/prefill", "services/decode"),
        _prefill_decode_forbids,
        (("services/prefill",), ("services/decode",)),
    ),
    Rule("pb-only-at-edges", ("services",), _pb_forbids),
)


# --- the tree ----------------------------------------------------------------------------------


def module_name(root: Path, path: Path) -> str:
    """services/a/b.py -> services.a.b; services/a/__init__.py -> services.a."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(root: Path, folder: str = PACKAGE) -> list[Path]:
    """Every .py file under root/folder, sorted (no __pycache__)."""
    return sorted(p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts)


def is_generated(root: Path, path: Path) -> bool:
    return _under(module_name(root, path), PB_PACKAGE)


def _in_folders(root: Path, path: Path, folders: Iterable[str]) -> bool:
    rel = path.relative_to(root).as_posix()
    return any(rel == f"{f}.py" or rel.startswith(f + "/") for f in folders)


# --- static: every import in the AST -----------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _resolve_relative(package: str, name: str, level: int) -> str | None:
    """`from ..x import y` inside package a.b.c (level 2) -> a.b.x; None if above the top."""
    parts = package.split(".")
    if level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (level - 1)])
    return f"{base}.{name}" if name else base


def _literal_import_call(node: ast.Call) -> tuple[str, str | None] | None:
    """`importlib.import_module("x"[, package])`, `import_module("x")` or `__import__("x")`:
    (the literal name, the package argument's literal or "__package__"), else None."""
    func = node.func
    is_import_module = (
        isinstance(func, ast.Attribute)
        and func.attr == "import_module"
        and isinstance(func.value, ast.Name)
        and func.value.id == "importlib"
    ) or (isinstance(func, ast.Name) and func.id == "import_module")
    is_dunder = isinstance(func, ast.Name) and func.id == "__import__"
    if not (is_import_module or is_dunder) or not node.args:
        return None
    first = node.args[0]
    if not isinstance(first, ast.Constant) or not isinstance(first.value, str):
        return None
    package: str | None = None
    if is_import_module:
        arg = node.args[1] if len(node.args) > 1 else None
        for keyword in node.keywords:
            if keyword.arg == "package":
                arg = keyword.value
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            package = arg.value
        elif isinstance(arg, ast.Name) and arg.id == "__package__":
            package = "__package__"
    return first.value, package


class _ImportCollector:
    """Walks one module's AST, tracking whether each node runs at import, under
    `if TYPE_CHECKING:`, or inside a function (or lambda)."""

    def __init__(self, importer: str, package: str) -> None:
        self.importer = importer
        self.package = package
        self.records: list[ImportRecord] = []

    def visit(self, node: ast.AST, level: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            level = FUNCTION_LEVEL
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            inner = FUNCTION_LEVEL if level == FUNCTION_LEVEL else TYPE_CHECKING_LEVEL
            for stmt in node.body:
                self.visit(stmt, inner)
            for stmt in node.orelse:
                self.visit(stmt, level)
            return
        self._record(node, level)
        for child in ast.iter_child_nodes(node):
            self.visit(child, level)

    def _add(self, target: str | None, names: tuple[str, ...], line: int, level: str) -> None:
        if target:
            self.records.append(ImportRecord(self.importer, target, names, line, level))

    def _record(self, node: ast.AST, level: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                self._add(alias.name, (), node.lineno, level)
        elif isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names if alias.name != "*")
            if node.level:
                target = _resolve_relative(self.package, node.module or "", node.level)
            else:
                target = node.module
            self._add(target, names, node.lineno, level)
        elif isinstance(node, ast.Call):
            call = _literal_import_call(node)
            if call is None:
                return
            name, package = call
            if name.startswith("."):
                base = self.package if package in ("__package__", None) else package
                dots = len(name) - len(name.lstrip("."))
                self._add(_resolve_relative(base, name[dots:], dots), (), node.lineno, level)
            else:
                self._add(name, (), node.lineno, level)


def collect_imports(root: Path, path: Path) -> list[ImportRecord]:
    """Every import in one file, at any level (relative imports resolved)."""
    importer = module_name(root, path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    collector = _ImportCollector(importer, package)
    collector.visit(tree, MODULE_LEVEL)
    return collector.records


def imported_modules(record: ImportRecord, known: set[str]) -> list[str]:
    """The modules one record imports: for `from pkg import x`, pkg.x where that is one of
    ours (`known`) or, outside our package, may be one (torch.nn); else pkg itself."""
    if not record.names:
        return [record.target]
    ours = _under(record.target, PACKAGE)
    out = []
    for name in record.names:
        candidate = f"{record.target}.{name}"
        if candidate in known or not ours:
            out.append(candidate)
        else:
            out.append(record.target)
    return list(dict.fromkeys(out))


def scan(root: Path) -> tuple[dict[Path, list[ImportRecord]], set[str]]:
    """Every file of the package but the generated ones: its imports; and every module name."""
    files = python_files(root)
    known = {module_name(root, p) for p in files}
    imports = {p: collect_imports(root, p) for p in files if not is_generated(root, p)}
    return imports, known


def _static_violations(
    root: Path, imports: dict[Path, list[ImportRecord]], known: set[str]
) -> list[Violation]:
    found: set[Violation] = set()
    for rule in RULES:
        for path, records in imports.items():
            if not _in_folders(root, path, rule.folders):
                continue
            where_file = path.relative_to(root).as_posix()
            for record in records:
                for name in imported_modules(record, known):
                    if rule.forbids(record.importer, name):
                        where = f"{where_file}:{record.line}"
                        found.add(Violation(rule.name, record.importer, name, where))
                        break
    return sorted(found)


def stale_pb_importers(imports: dict[Path, list[ImportRecord]], known: set[str]) -> list[str]:
    """Allowlisted modules that no longer import a generated module (the list can shrink)."""
    importers = {
        record.importer
        for records in imports.values()
        for record in records
        if any(_under(name, PB_PACKAGE) for name in imported_modules(record, known))
    }
    return sorted(set(PB_IMPORTERS) - importers)


# --- runtime: what importing really loads ------------------------------------------------------
#
# One interpreter per rule (`python check_imports.py --probe REQUEST`, cwd = the checked root)
# first imports the third-party modules that the rule's modules import when imported (torch,
# grpc: the slow part) and checks that they loaded nothing the rule forbids. Then, per group, a
# forked child imports all the group's modules in order and reports, per module, what its import
# added to sys.modules: if nothing forbidden, every module is clean (the fast path). Else the
# first module that loaded something forbidden is a culprit, the ones before it are clean (all
# they loaded was loaded while nothing forbidden was), and the ones after it are imported again
# in a new child, since what the culprit loaded would hide theirs; until none is left. A forked
# child starts from the clean preload, as a fresh interpreter would (but faster).

Result = tuple[str, str, list[str]]  # (module, "ok" | "skipped: ..." | "error: ...", loaded)


def _import_one(module: str) -> Result:
    before = set(sys.modules)
    status = "ok"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if _under(missing, PACKAGE):
            status = f"error: {exc!r}"
        else:  # an optional extra that is not installed (ray for services/ray_serve)
            status = f"skipped: needs {missing}"
    except BaseException as exc:  # SystemExit too: reported, not raised
        status = f"error: {type(exc).__name__}: {exc}"
    return module, status, sorted(set(sys.modules) - before)


def _import_in_child(modules: list[str], out: Path, deadline_s: float) -> list[Result]:
    """`modules` imported in order by a forked child (this process stays as it is)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: import, write, leave without running the parent's cleanup
        code = 0
        try:
            out.write_text(json.dumps([_import_one(module) for module in modules]))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    start = time.monotonic()
    while (os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() - start > deadline_s:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return [(m, f"error: no answer within {deadline_s:.0f} s", []) for m in modules]
        time.sleep(0.01)
    if not out.exists():
        return [(m, "error: the importing process died", []) for m in modules]
    return [(module, status, new) for module, status, new in json.loads(out.read_text())]


def _first_finding(rule: Rule, results: list[Result]) -> int | None:
    """The index of the first module that failed to import or loaded something forbidden."""
    for i, (module, status, new) in enumerate(results):
        if status.startswith("error") or any(rule.forbids(module, name) for name in new):
            return i
    return None


def _probe_main(request: dict) -> None:
    """In the probe interpreter: preload, check it is clean, then each group as described above."""
    root = request["root"]
    sys.path.insert(0, root)
    import services

    here = Path(services.__file__).resolve().parent
    if not here.is_relative_to(Path(root).resolve()):
        raise SystemExit(f"imported services from {here}, not from {root}")
    rule = next(rule for rule in RULES if rule.name == request["rule"])
    groups: list[list[str]] = request["groups"]
    for module in request["preload"]:
        try:
            importlib.import_module(module)
        except Exception:  # what fails here fails again in the child, and is reported there
            pass
    # A rule sees an importer only through its package (services.engine, services.prefill).
    importers = {".".join(module.split(".")[:2]) for group in groups for module in group}
    dirty = sorted(n for n in sys.modules if any(rule.forbids(m, n) for m in importers))
    results: list[Result] = []
    if not dirty:
        deadline_s = _SUBPROCESS_TIMEOUT_S / 3
        with tempfile.TemporaryDirectory() as tmp:
            for g, modules in enumerate(groups):
                for attempt in range(len(modules)):
                    found = _import_in_child(modules, Path(tmp, f"{g}-{attempt}"), deadline_s)
                    index = _first_finding(rule, found)
                    results += found if index is None else found[: index + 1]
                    if index is None:
                        break
                    modules = modules[index + 1 :]
                    if not modules:
                        break
    print(_MARKER + json.dumps({"dirty": dirty, "results": results}), flush=True)


def _probe(root: Path, rule: Rule, groups: list[list[str]], preload: list[str]) -> list[Result]:
    """What importing each module of `groups` loads that the rule forbids (see above), from a
    fresh interpreter that has imported `preload` (dropped if that loaded anything forbidden)."""
    request = {"root": str(root), "rule": rule.name, "groups": groups, "preload": preload}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--probe", json.dumps(request)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=_SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARKER):
            answer = json.loads(line[len(_MARKER) :])
            if answer["dirty"]:
                return _probe(root, rule, groups, [])
            return [(module, status, new) for module, status, new in answer["results"]]
    raise RuntimeError(f"import probe failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def _shortest_forbidden(rule: Rule, importer: str, name: str) -> str:
    """grpc._channel -> grpc: the outermost forbidden package of a loaded module."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if rule.forbids(importer, prefix):
            return prefix
    return name


def _runtime_violations(rule: Rule, results: list[Result]) -> list[Violation]:
    """A violation for each forbidden package a module's import loaded, and each failed import."""
    out = []
    for module, status, new in results:
        bad = {_shortest_forbidden(rule, module, n) for n in new if rule.forbids(module, n)}
        out += [Violation(rule.name, module, name, RUNTIME) for name in sorted(bad)]
        if status.startswith("error"):
            out.append(Violation(rule.name, module, f"{_IMPORT_FAILED} ({status[7:]})", RUNTIME))
    return out


def _runtime_groups(root: Path, rule: Rule) -> list[list[str]]:
    files = python_files(root)
    return [
        [module_name(root, p) for p in files if _in_folders(root, p, folders)]
        for folders in rule.runtime_groups
    ]


def _preload(
    root: Path, rule: Rule, imports: dict[Path, list[ImportRecord]], known: set[str]
) -> list[str]:
    """The third-party modules that importing the rule's modules imports (statically, through
    module-level imports of ours), but those the rule forbids: loaded once, before the forks."""
    by_module = {module_name(root, path): records for path, records in imports.items()}
    checked = [m for group in _runtime_groups(root, rule) for m in group]
    todo, seen, third_party = list(checked), set(checked), set()
    while todo:
        for record in by_module.get(todo.pop(), []):
            if record.level != MODULE_LEVEL:
                continue
            if not _under(record.target, PACKAGE):
                third_party.add(record.target)
                continue
            for name in imported_modules(record, known):
                parts = name.split(".")
                for i in range(2, len(parts) + 1):  # its packages' __init__ run too
                    if (parent := ".".join(parts[:i])) in known and parent not in seen:
                        seen.add(parent)
                        todo.append(parent)
    return sorted(n for n in third_party if not any(rule.forbids(m, n) for m in checked))


def _check_runtime(
    root: Path,
    rule: Rule,
    imports: dict[Path, list[ImportRecord]],
    known: set[str],
    skipped: dict[str, str],
) -> list[Violation]:
    groups = _runtime_groups(root, rule)
    results = _probe(root, rule, groups, _preload(root, rule, imports, known))
    for module, status, _ in results:
        if status.startswith("skipped"):
            skipped[module] = status.removeprefix("skipped: ")
    return _runtime_violations(rule, results)


def run_checks(root: Path, runtime: bool = True) -> Report:
    """Every rule, statically and (unless `runtime` is False) at runtime."""
    start = time.monotonic()
    root = root.resolve()
    imports, known = scan(root)
    report = Report(num_files=len(imports))
    report.violations = _static_violations(root, imports, known)
    report.stale_pb_importers = stale_pb_importers(imports, known)
    if runtime:
        rules = [rule for rule in RULES if rule.runtime_groups]
        report.num_runtime_modules = sum(
            len(group) for rule in rules for group in _runtime_groups(root, rule)
        )
        # One interpreter per rule, side by side (most of each is importing torch or grpc).
        with ThreadPoolExecutor(max_workers=len(rules)) as pool:
            futures = [
                pool.submit(_check_runtime, root, rule, imports, known, report.skipped)
                for rule in rules
            ]
            for future in futures:
                report.violations += future.result()
    report.seconds = time.monotonic() - start
    return report


def check(root: Path) -> list[Violation]:
    """Every violation of every rule under root/services, static ones first."""
    return run_checks(root).violations


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:  # the runtime check's interpreter (see _probe)
        _probe_main(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "root", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent
    )
    parser.add_argument("--static-only", action="store_true", help="skip the runtime checks")
    args = parser.parse_args(argv)
    report = run_checks(args.root, runtime=not args.static_only)
    for violation in report.violations:
        print(violation)
    for module in report.stale_pb_importers:
        print(f"note: {module} no longer imports {PB_PACKAGE}: drop it from PB_IMPORTERS")
    for module, why in sorted(report.skipped.items()):
        print(f"note: {module} not imported at runtime ({why}); checked statically only")
    if report.violations:
        print(f"import boundaries: {len(report.violations)} violation(s)")
        return 1
    how = "statically" if args.static_only else "statically and at runtime"
    print(
        f"import boundaries: OK ({len(RULES)} rules, {report.num_files} files {how}, "
        f"{report.num_runtime_modules} modules imported, {report.seconds:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
