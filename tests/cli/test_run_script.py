"""`bash scripts/run.sh`, the README's main job, end to end: its transcript (stdout and stderr in
one stream, as a terminal shows them) has the streamed answer to the default question, with no
service log line inside it; the services' lines are in the log file it names."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# A fresh clone installs (about a minute), converts the model (~15 s) and compiles the kernel
# (~30 s) first; a cached run takes about 30 s on 2 cores.
TIMEOUT_S = 900
QUESTION = "Q: What is the capital of France?"
_PROGRESS = "==> "  # run.sh's own lines
# What a log line looks like, anywhere in a line (one can land in the middle of the answer):
_LOG_MARKS = re.compile(
    "|".join(
        (
            r"\[(?:router|serve|prefill|decode)(?:-\d+)?\]",  # a relayed child's name, a role
            r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d",  # a record's time
            r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \[",  # the text format's level and role
            r"request_id=",
            r'"level": ?"',  # a JSON record
            r"pdserve: ",  # the supervisor's and the engine's own messages
            r"[EWIF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]",  # gRPC's C core (absl)
            r"Traceback \(most recent call last\)",
        )
    )
)


def answer_section(transcript: str) -> str:
    """What follows the question line, up to run.sh's next `==> ` line (the answer, and whatever
    else was printed meanwhile). AssertionError when there is no question line."""
    lines = transcript.splitlines()
    assert QUESTION in lines, f"no {QUESTION!r} line in:\n{transcript}"
    answer: list[str] = []
    for line in lines[lines.index(QUESTION) + 1 :]:
        if line.startswith(_PROGRESS):
            break
        answer.append(line)
    return "\n".join(answer)


def log_lines_in(answer: str) -> list[str]:
    """The lines of `answer` that carry a log line, or part of one."""
    return [line for line in answer.splitlines() if _LOG_MARKS.search(line)]


def run_script(**env: str) -> subprocess.CompletedProcess[str]:
    """`bash scripts/run.sh` with its output merged as a terminal shows it."""
    drop = ("PDSERVE_RUN_LOGS", "PDSERVE_LOGGING_LEVEL", "PDSERVE_LOG_FORMAT")  # its defaults
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        ["bash", "scripts/run.sh"],
        cwd=ROOT,
        env={**environ, **env},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def transcript() -> str:
    done = run_script()
    assert done.returncode == 0, done.stdout
    return done.stdout


def test_the_answer_streams_with_no_log_line_inside(transcript):
    answer = answer_section(transcript)
    assert answer.startswith("A: ") and "Paris" in answer, transcript
    assert log_lines_in(answer) == [], transcript
    assert any(line.startswith("==> ready in ") for line in transcript.splitlines())
    # Every service's lines went to the log file run.sh names (`pdserve serve --log-file`).
    [log] = set(re.findall(r"its logs: (\S+\.log)$", transcript, re.MULTILINE))
    text = Path(log).read_text()
    for name in ("router", "prefill-0", "decode-0"):
        assert f"[{name}] " in text, text
    assert "request finished" in text, text


def test_the_check_catches_logs_shown_on_the_terminal():
    """PDSERVE_RUN_LOGS=terminal (run.sh's debugging switch) shows the services' lines as they
    come: the request's own lines then land inside the answer, and the check must say so."""
    done = run_script(PDSERVE_RUN_LOGS="terminal")
    assert done.returncode == 0, done.stdout
    answer = answer_section(done.stdout)
    assert "Paris" in answer, done.stdout
    found = log_lines_in(answer)
    assert any("[router] " in line and "request finished" in line for line in found), answer


@pytest.mark.parametrize(
    "planted",
    [
        "[decode-0] 2026-12-03 17:45:12,345 INFO [decode] services.kv_transfer.control.receiver "
        "request_id=abc: KV from 127.0.0.1:33553 (prefill-0-1f2e) over shared_memory",
        '{"time": "2026-12-03T17:45:12+0000", "level": "INFO", "logger": "services.router", '
        '"message": "request finished", "role": "router", "pid": 7, "request_id": "abc"}',
        "pdserve: warning: decode-0 (pid 7) still running 10 s after SIGTERM; killing it",
    ],
)
@pytest.mark.parametrize("mid_line", [False, True])
def test_the_check_catches_a_planted_log_line(transcript, planted, mid_line):
    """The real transcript with a log line planted in the answer: at the start of a line, or
    mid-line after the answer's first word (as an unbuffered stderr write lands)."""
    lines = transcript.splitlines()
    at = lines.index(QUESTION) + 1
    if mid_line:
        cut = lines[at].index(" ", len("A: "))  # after "A: The"
        lines[at] = f"{lines[at][:cut]}{planted}\n{lines[at][cut:]}"
    else:
        lines.insert(at + 1, planted)
    found = log_lines_in(answer_section("\n".join(lines)))
    assert len(found) == 1 and planted in found[0]
