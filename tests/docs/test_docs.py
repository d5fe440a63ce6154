"""The README and docs/ stay true to the repository: every package's one-line docstring is the
line docs/architecture.md gives it, the flags reference is what its generator writes now, links
and repository paths in the docs resolve, and no source file cites a document outside the repo."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BEGIN, END = "<!-- packages:begin -->", "<!-- packages:end -->"
_PACKAGE_LINE = re.compile(r"^- `(services(?:/\w+)*)/`: (.*)$")

# Where source files may not point: the design card outside the repository. Spelled in two
# parts so that this file does not cite them itself.
SOURCE_FOLDERS = ("services", "tests", "scripts", "benchmarks", "deploy")
OUTSIDE = ("ARCHITECTURE" + ".md", ".." + "/shared")

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_REPO_PATH = re.compile(r"`((?:services|tests|scripts|benchmarks|deploy|proto|docs)/[^`\s]*)`")
# Paths the docs name that exist only once something ran: targets files `pdserve serve` or the
# Ray registry writes, and the GPU benchmark's results (no GPU run yet).
WRITTEN_AT_RUN_TIME = ("deploy/prometheus/targets/", "benchmarks/results/gpu.json")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _package_docstrings() -> dict[str, str | None]:
    """{"services/router/flow": its __init__ docstring (None: none)} for every package."""
    docs: dict[str, str | None] = {}
    for init in sorted((ROOT / "services").rglob("__init__.py")):
        if "__pycache__" not in init.parts:
            tree = ast.parse(init.read_text(), filename=str(init))
            docs[_rel(init.parent)] = ast.get_docstring(tree, clean=False)
    return docs


def _listed_packages() -> dict[str, str]:
    """{"services/router/flow": its line} from docs/architecture.md's package list."""
    text = ARCHITECTURE.read_text()
    assert BEGIN in text and END in text, f"docs/architecture.md lacks {BEGIN} ... {END}"
    listed: dict[str, str] = {}
    for line in text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines():
        match = _PACKAGE_LINE.match(line)
        assert match, f"docs/architecture.md: not a `- `services/...`/`: DOCSTRING` line: {line!r}"
        listed[match[1]] = match[2]
    return listed


def test_every_package_has_a_one_line_docstring():
    bad = [
        f"{package}/__init__.py: "
        + ("no docstring" if doc is None or not doc.strip() else "docstring of several lines")
        for package, doc in _package_docstrings().items()
        if doc is None or not doc.strip() or "\n" in doc.strip()
    ]
    assert not bad, "each package says what it is in one line:\n" + "\n".join(bad)


def test_architecture_lists_every_package_with_its_docstring():
    actual = {package: (doc or "").strip() for package, doc in _package_docstrings().items()}
    listed = _listed_packages()
    problems = [
        f"{package}: not in docs/architecture.md's package list; add: - `{package}/`: {doc}"
        for package, doc in actual.items()
        if package not in listed
    ]
    problems += [
        f"{package}: in docs/architecture.md's package list, but there is no such package"
        for package in listed
        if package not in actual
    ]
    problems += [
        f"{package}: its docstring says {actual[package]!r}, docs/architecture.md says {line!r}"
        for package, line in listed.items()
        if package in actual and actual[package] != line
    ]
    assert not problems, "\n".join(problems)


def test_flags_reference_is_fresh():
    done = subprocess.run(
        [sys.executable, "scripts/gen_flags_doc.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def _text_files(folder: Path) -> Iterator[tuple[Path, str]]:
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        try:
            yield path, path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # binary (images, compiled files)
            continue


def test_no_source_cites_a_document_outside_the_repo():
    found = [
        f"{_rel(path)}:{number}: {line.strip()}"
        for folder in SOURCE_FOLDERS
        for path, text in _text_files(ROOT / folder)
        for number, line in enumerate(text.splitlines(), 1)
        if any(needle in line for needle in OUTSIDE)
    ]
    assert not found, "point at docs/architecture.md (in the repo) instead:\n" + "\n".join(found)


def _prose(path: Path) -> Iterator[str]:
    """The lines of a Markdown file outside fenced code blocks."""
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield line


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(path):
        match = _HEADING.match(line)
        if match:
            slug = _slug(match[2])
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        for line in _prose(doc):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (doc.parent / file_part).resolve() if file_part else doc
                if not dest.is_relative_to(ROOT) or not dest.exists():
                    broken.append(f"{_rel(doc)}: ({target}): no such file")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{_rel(doc)}: ({target}): no heading #{anchor} in {_rel(dest)}")
    assert not broken, "\n".join(broken)


def test_repository_paths_in_the_docs_exist():
    missing = []
    for doc in DOCS:
        for line in _prose(doc):
            for found in _REPO_PATH.findall(line):
                path = found.split("::")[0].rstrip(".,;:")
                if any(c in path for c in "*<>{}$") or path.startswith(WRITTEN_AT_RUN_TIME):
                    continue
                if not (ROOT / path).exists():
                    missing.append(f"{_rel(doc)}: `{found}`")
    assert not missing, "paths the docs name that do not exist (moved?):\n" + "\n".join(missing)
