"""The import-boundary check: the real tree passes it, and a planted break of each rule fails it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import check_imports  # noqa: E402  (scripts/ is no package: found through the lines above)
from check_imports import RUNTIME, Violation  # noqa: E402

ENGINE, NO_TORCH = "engine-no-transport", "router-cli-no-torch"
APART, PB = "prefill-decode-apart", "pb-only-at-edges"

# Planted in one copy of services/ (path -> source); each breaks one rule in its own way.
PLANTS = {
    # Function-level imports: only the static check sees them.
    "services/engine/planted_rpc.py": (
        "def stub():\n"
        "    import grpc\n"
        "\n"
        "    return grpc\n"
        "\n"
        "\n"
        "def cache():\n"
        '    return __import__("redis")\n'
    ),
    # A literal importlib.import_module at module level: both checks see it.
    "services/engine/planted_metrics.py": (
        'import importlib\n\nprometheus_client = importlib.import_module("prometheus_client")\n'
    ),
    # Needs an extra that is not installed: skipped at runtime, still checked statically.
    "services/engine/planted_extra.py": "import pdserve_uninstalled_extra\nimport redis\n",
    "services/router/planted_torch.py": "import torch\n",
    # torch through a module of ours that is allowed it: only the runtime check sees it.
    "services/worker/planted_heavy.py": "import torch\n",
    "services/router/planted_transitive.py": "from services.worker import planted_heavy\n",
    # Type-only: never loaded, still forbidden.
    "services/cli/planted_types.py": (
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import torch\n"
    ),
    "services/prefill/planted_decode.py": "from services.decode import server\n",
    "services/decode/planted_prefill.py": (
        "def prefill_server():\n    from ..prefill import server\n\n    return server\n"
    ),
    "services/config/planted_pb.py": (
        "def to_proto():\n"
        "    from services.common.pb import generate_pb2\n"
        "\n"
        "    return generate_pb2\n"
    ),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> list[Violation]:
    """Every violation `check` finds in one copy of services/ with all of PLANTS in it."""
    root = tmp_path_factory.mktemp("planted")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "services", root / "services", ignore=ignore)
    for path, source in PLANTS.items():
        (root / path).write_text(source)
    return check_imports.check(root)


def _static(violations: list[Violation], rule: str, module: str) -> list[tuple[str, str]]:
    """(what, file:line) of the static violations of `rule` by `module`."""
    return [
        (v.what, v.where)
        for v in violations
        if v.rule == rule and v.module == module and v.where != RUNTIME
    ]


def _runtime(violations: list[Violation], rule: str, module: str) -> list[str]:
    """What `module` loads against `rule`, as the runtime check saw it."""
    return [
        v.what for v in violations if v.rule == rule and v.module == module and v.where == RUNTIME
    ]


def test_the_real_tree_keeps_every_boundary() -> None:
    report = check_imports.run_checks(ROOT)
    assert [str(v) for v in report.violations] == []
    # The runtime side ran: the engine's, the router's, the CLI's and both workers' modules.
    assert report.num_runtime_modules > 50


def test_engine_function_level_imports_are_caught_statically(planted: list[Violation]) -> None:
    module = "services.engine.planted_rpc"
    assert _static(planted, ENGINE, module) == [
        ("grpc", "services/engine/planted_rpc.py:2"),
        ("redis", "services/engine/planted_rpc.py:8"),
    ]
    # Importing the module loads neither: only the static check can see these.
    assert _runtime(planted, ENGINE, module) == []


def test_engine_import_module_literal_is_caught_both_ways(planted: list[Violation]) -> None:
    module = "services.engine.planted_metrics"
    assert _static(planted, ENGINE, module) == [
        ("prometheus_client", "services/engine/planted_metrics.py:3")
    ]
    assert _runtime(planted, ENGINE, module) == ["prometheus_client"]


def test_a_module_needing_a_missing_extra_is_still_checked_statically(
    planted: list[Violation],
) -> None:
    module = "services.engine.planted_extra"
    assert _static(planted, ENGINE, module) == [("redis", "services/engine/planted_extra.py:2")]
    assert _runtime(planted, ENGINE, module) == []  # skipped, not failed


def test_router_importing_torch_is_caught_both_ways(planted: list[Violation]) -> None:
    module = "services.router.planted_torch"
    assert _static(planted, NO_TORCH, module) == [("torch", "services/router/planted_torch.py:1")]
    assert _runtime(planted, NO_TORCH, module) == ["torch"]


def test_router_loading_torch_through_another_module_is_caught_at_runtime(
    planted: list[Violation],
) -> None:
    module = "services.router.planted_transitive"
    assert _static(planted, NO_TORCH, module) == []
    assert _runtime(planted, NO_TORCH, module) == ["torch"]


def test_cli_type_only_torch_import_is_caught_statically(planted: list[Violation]) -> None:
    module = "services.cli.planted_types"
    assert _static(planted, NO_TORCH, module) == [("torch", "services/cli/planted_types.py:4")]
    assert _runtime(planted, NO_TORCH, module) == []


def test_prefill_importing_decode_is_caught_both_ways(planted: list[Violation]) -> None:
    module = "services.prefill.planted_decode"
    assert _static(planted, APART, module) == [
        ("services.decode.server", "services/prefill/planted_decode.py:1")
    ]
    assert _runtime(planted, APART, module) == ["services.decode"]


def test_decode_importing_prefill_relatively_is_caught(planted: list[Violation]) -> None:
    module = "services.decode.planted_prefill"
    assert _static(planted, APART, module) == [
        ("services.prefill.server", "services/decode/planted_prefill.py:2")
    ]


def test_protobuf_outside_the_allowlist_is_caught(planted: list[Violation]) -> None:
    module = "services.config.planted_pb"
    assert _static(planted, PB, module) == [
        ("services.common.pb.generate_pb2", "services/config/planted_pb.py:2")
    ]


def test_only_the_planted_modules_are_named(planted: list[Violation]) -> None:
    named = {v.module for v in planted}
    assert named == {
        ".".join(Path(path).with_suffix("").parts)
        for path in PLANTS
        if path != "services/worker/planted_heavy.py"  # allowed torch; its importer is not
    }
