"""The layout rules of services/ (docs/architecture.md: Packages, Style 1), measured by
scripts/code_figures.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "scripts") not in sys.path:
    sys.path.insert(0, str(ROOT / "scripts"))

import code_figures  # noqa: E402  (scripts/ is no package: found through the lines above)

MAX_MODULES_PER_FOLDER = 15  # but in services/engine and its sub-folders
MAX_ROOT_MODULES = 3
COMMON_PLUMBING = {
    "channels",
    "convert",
    "errors",
    "grpc_server",
    "logs",
    "member_leases",
    "metrics",
    "request_id",
    "thread_pool",
}


@pytest.fixture(scope="module")
def folders() -> dict[str, list[str]]:
    return code_figures.modules_per_folder(ROOT)


def test_no_folder_but_the_engine_holds_more_than_15_modules(
    folders: dict[str, list[str]],
) -> None:
    crowded = {
        folder: len(modules)
        for folder, modules in folders.items()
        if len(modules) > MAX_MODULES_PER_FOLDER
        and not (folder == "services/engine" or folder.startswith("services/engine/"))
    }
    assert crowded == {}


def test_services_root_holds_at_most_3_modules(folders: dict[str, list[str]]) -> None:
    assert len(folders["services"]) <= MAX_ROOT_MODULES, folders["services"]


def test_common_holds_only_plumbing(folders: dict[str, list[str]]) -> None:
    assert set(folders["services/common"]) - COMMON_PLUMBING == set()


def test_no_module_over_400_lines() -> None:
    assert code_figures.long_modules(ROOT, code_figures.MAX_MODULE_LINES) == {}


def test_every_module_over_300_lines_has_a_reason() -> None:
    long = code_figures.long_modules(ROOT, code_figures.LONG_MODULE_LINES)
    assert {p: n for p, n in long.items() if p not in code_figures.LONG_MODULES} == {}


def test_no_import_cycles_not_even_type_only() -> None:
    assert [str(cycle) for cycle in code_figures.import_cycles(ROOT)] == []


def test_json_output_holds_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert code_figures.main(["--json", "--static-only"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["files"] > 100 and figures["lines"] > 10_000
    assert figures["modules_per_folder"]["services/engine"]["modules"] > 10
    assert figures["largest_function"]["lines"] > 0
    assert figures["import_boundaries"]["runtime"] is False
    assert "services/common/pb" not in figures["modules_per_folder"]


def test_the_script_prints_the_table() -> None:
    # --static-only: the runtime import check's own test (test_import_boundaries.py) runs it.
    proc = subprocess.run(
        [sys.executable, "scripts/code_figures.py", "--static-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    labels = {line.split("  ")[1] for line in lines if line.startswith("  ") and "  " in line[2:]}
    for label in ("files", "lines", "largest function", "import boundaries", "folder"):
        assert label in labels, proc.stdout
    assert "Modules per folder" in lines
    # One row per folder, the generated protobuf package left out.
    rows = [line.split() for line in lines if line.startswith("  services")]
    assert ["services/engine"] in [row[:1] for row in rows]
    assert not any(row[0].startswith("services/common/pb") for row in rows)
