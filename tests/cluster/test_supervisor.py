"""`pdserve serve`'s supervisor with fake children: the ready line, stops, start failures,
and restarts of a child that dies while serving (`services/cluster/supervisor.py`,
`cluster/restarts.py`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.cluster import launcher, supervisor
from services.cluster.restarts import RestartPolicy, bound_ports
from services.common import logs

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


FAKE_SERVICE = """
import json, os, signal, sys, time
role, mode = sys.argv[1], sys.argv[2]
print(f"{role} starting", file=sys.stderr, flush=True)
marker_dir = os.environ.get("FAKE_MARKER_DIR")  # where the modes that act on "first" keep it
marker = os.path.join(marker_dir, role + ".started") if marker_dir else None
first = marker is None or not os.path.exists(marker)
if marker is not None:
    open(marker, "a").close()
if mode.startswith("chatty"):  # long stderr lines from several children at once
    for i in range(200):
        print(f"{role} line {i} " + "x" * 5000, file=sys.stderr, flush=True)
    if mode == "chatty-die":
        sys.exit(3)
if mode == "die-after-first" and not first:
    sys.exit(5)
if mode == "die":
    print(f"{role}: cannot load the model", file=sys.stderr, flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(60)
if mode == "bad":
    print("ready {not json", flush=True)
    time.sleep(60)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
port = 20000 + os.getpid() % 20000
info = {"role": role, "grpc": f"127.0.0.1:{port}",
        "metrics": f"http://127.0.0.1:{port + 1}/metrics", "pid": os.getpid()}
if role == "router":
    info["http"] = "http://127.0.0.1:8000"
print("ready " + json.dumps(info), flush=True)
print("stdout after ready goes to the supervisor's stderr", flush=True)
if mode == "exit-after-ready" or (mode in ("exit-once", "die-after-first") and first):
    time.sleep(1.0)
    sys.exit(4)
while True:
    time.sleep(1)
"""


@pytest.fixture(autouse=True)
def no_log_setup_left_over(monkeypatch, restore_logging):
    """The supervisor prints its own messages unless a log set-up of this process filters them
    (`logs.lets_through`): start each test with none left by an earlier test in this
    interpreter (a `cli.main` call configures logging); `restore_logging` puts it back."""
    monkeypatch.delenv("PDSERVE_LOGGING_LEVEL", raising=False)
    for handler in list(restore_logging.handlers):
        if handler.get_name() == "pdserve":
            restore_logging.removeHandler(handler)


DRIVER = """
import sys
from services.cluster.launcher import ChildSpec, ClusterSpec
from services.cluster.restarts import RestartPolicy
from services.cluster.supervisor import Supervisor

fake, mode, stop_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
failures = int(sys.argv[4]) if len(sys.argv) > 4 else 5

def child(name, role, mode, *extra):
    return ChildSpec(name, role, [sys.executable, fake, role, mode, *extra])

only_decode = mode in ("exit-once", "die-after-first")
workers = [child("prefill-0", "prefill", "ok" if only_decode else mode),
           child("prefill-1", "prefill", "ok" if only_decode else mode),
           child("decode-0", "decode", mode)]
spec = ClusterSpec(workers, lambda p, d: child("router", "router", "ok", *p, *d), start_timeout=30,
                   stop_timeout=stop_timeout)
policy = RestartPolicy(max_start_failures=failures, initial_s=0.1, max_s=0.2)
sys.exit(Supervisor(spec, policy).run())
"""


@pytest.fixture
def fake_service(tmp_path) -> str:
    path = tmp_path / "fake_service.py"
    path.write_text(FAKE_SERVICE)
    return str(path)


def _spec(
    fake: str, modes: dict[str, str], routed: list | None = None, **kwargs
) -> launcher.ClusterSpec:
    def child(name: str, role: str, *extra: str) -> launcher.ChildSpec:
        return launcher.ChildSpec(
            name, role, [sys.executable, fake, role, modes.get(name, "ok"), *extra]
        )

    def router(prefill: list[str], decode: list[str]) -> launcher.ChildSpec:
        if routed is not None:
            routed.append((prefill, decode))
        return child("router", "router")

    return launcher.ClusterSpec(
        [child("prefill-0", "prefill"), child("decode-0", "decode")], router, **kwargs
    )


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie awaiting its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _wait_dead(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _start_driver(
    tmp_path: Path, fake: str, mode: str = "ok", stop_timeout: float = 10.0, failures: int = 5
):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(driver), fake, mode, str(stop_timeout), str(failures)],
        cwd=ROOT,
        env={**ENV, "FAKE_MARKER_DIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"no ready line; stderr: {proc.communicate()[1]}")
    assert line.startswith("ready "), (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, json.loads(line[len("ready ") :])


def test_serve_ready_line_and_sigterm_stops_every_child(tmp_path, fake_service):
    proc, info = _start_driver(tmp_path, fake_service)
    try:
        assert set(info) == {"router", "http", "services", "core_ledger"}
        assert info["core_ledger"] is None  # this spec lends no cores
        assert [s["role"] for s in info["services"]] == ["router", "prefill", "prefill", "decode"]
        keys = {"role", "name", "grpc", "metrics", "pid"}
        assert all(set(s) == keys for s in info["services"])
        assert (
            info["router"] == info["services"][0]["grpc"]
            and info["http"] == "http://127.0.0.1:8000"
        )
        assert all(
            s["metrics"].startswith("http://127.0.0.1:") and s["metrics"].endswith("/metrics")
            for s in info["services"]
        )
        pids = [s["pid"] for s in info["services"]]
        assert len(set(pids)) == 4 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out == "" and "[prefill-1] prefill starting" in err
    assert "[router] stdout after ready goes to the supervisor's stderr" in err
    assert _wait_dead(pids, timeout=2) == []


def test_serve_kills_children_that_ignore_sigterm(tmp_path, fake_service):
    proc, info = _start_driver(tmp_path, fake_service, mode="ignore-term", stop_timeout=1.0)
    pids = [s["pid"] for s in info["services"]]
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and time.monotonic() - start < 10
    assert "decode-0" in err and "still running 1 s after SIGTERM; killing it" in err
    assert _wait_dead(pids, timeout=2) == []


def test_killed_supervisor_leaves_no_orphans(tmp_path, fake_service):
    proc, info = _start_driver(tmp_path, fake_service)
    pids = [s["pid"] for s in info["services"]]
    proc.kill()  # no chance to clean up: the kernel's PR_SET_PDEATHSIG must do it
    proc.communicate(timeout=30)
    assert _wait_dead(pids) == []


def test_serve_fails_when_a_worker_dies_at_start(fake_service, capsys):
    routed: list = []
    assert (
        supervisor.Supervisor(
            _spec(fake_service, {"decode-0": "die"}, routed, stop_timeout=5)
        ).run()
        == 1
    )
    captured = capsys.readouterr()
    assert captured.out == "" and routed == []  # no router was started
    assert "pdserve: error: decode-0 (pid " in captured.err
    assert "exited with code 3 before it was ready; last stderr lines:" in captured.err
    assert "  decode: cannot load the model" in captured.err


def test_serve_log_file_gets_every_childs_lines_whole(fake_service, tmp_path, capsys, monkeypatch):
    """`pdserve serve --log-file`: the supervisor, the one writer, appends what it relays (and
    its own messages) to the file as whole lines, the same lines as on its stderr."""
    path = tmp_path / "serve.log"
    logs.configure("text", "serve", log_file=str(path))  # undone by the autouse fixture
    spec = _spec(fake_service, {"prefill-0": "chatty", "decode-0": "chatty-die"}, stop_timeout=5)
    assert supervisor.Supervisor(spec).run() == 1
    err = capsys.readouterr().err
    assert path.read_text() == err
    # (The error message's stderr tail quotes a few, indented.)
    chatty = [line for line in err.splitlines() if " line " in line and line[:2] != "  "]
    whole = re.compile(r"\[(prefill-0|decode-0)\] (prefill|decode) line \d+ x+")
    assert all(whole.fullmatch(line) for line in chatty)  # nothing spliced into a line
    assert [line for line in chatty if line.startswith("[decode-0]")] == [
        f"[decode-0] decode line {i} " + "x" * 5000 for i in range(200)
    ]
    assert "pdserve: error: decode-0 (pid " in err and "exited with code 3" in err


def test_serve_fails_when_a_worker_is_never_ready(fake_service, capsys):
    spec = _spec(fake_service, {"prefill-0": "hang"}, start_timeout=1.0, stop_timeout=5)
    start = time.monotonic()
    assert supervisor.Supervisor(spec).run() == 1
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert (
        "pdserve: error: prefill-0 (pid " in err
        and "not ready after 1 s" in err
        and "prefill starting" in err
    )


def test_serve_fails_on_a_bad_ready_line(fake_service, capsys):
    assert (
        supervisor.Supervisor(_spec(fake_service, {"prefill-0": "bad"}, stop_timeout=5)).run() == 1
    )
    assert "prefill-0 (pid " in capsys.readouterr().err


def test_serve_restarts_a_child_that_dies_while_serving(tmp_path, fake_service):
    """decode-0 exits 1 s after its first ready line: it is started again, serves, and the
    cluster keeps running until SIGTERM (exit 0)."""
    proc, info = _start_driver(tmp_path, fake_service, mode="exit-once")
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while not any("decode-0 is serving again at" in x for x in seen):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
        with contextlib.suppress(queue.Empty):
            seen.append(lines.get(timeout=0.5))
    log = "".join(seen)
    assert "decode-0 (pid " in log and "exited with code 4; restarting it in 0.1 s" in log
    assert "decode-0 restarted (pid " in log
    assert proc.poll() is None  # still serving
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    old = [s["pid"] for s in info["services"]]
    assert _wait_dead(old, timeout=2) == []


def test_serve_gives_up_on_a_child_that_keeps_dying_at_start(tmp_path, fake_service):
    """decode-0 serves, dies, and every restart dies before its ready line: after
    max_start_failures of those the supervisor stops the cluster (exit 1). (In a driver
    process, as the tests above: in this one, earlier tests' gRPC state once broke it.)"""
    proc, info = _start_driver(tmp_path, fake_service, mode="die-after-first", failures=3)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.count("decode-0 restarted (pid ") == 3, err
    assert "exited with code 5: 3 starts in a row failed; stopping the cluster" in err
    assert _wait_dead([s["pid"] for s in info["services"]], timeout=5) == []


def test_restart_policy_backs_off_and_resets():
    policy = RestartPolicy(max_start_failures=3, initial_s=1.0, max_s=5.0, stable_after_s=30.0)
    assert [policy.on_exit("a", 2.0) for _ in range(4)] == [1.0, 2.0, 4.0, 5.0]
    assert policy.on_exit("a", 60.0) == 1.0  # it had run stably: back to the first delay
    assert policy.on_exit("b", None) == 1.0 and policy.on_exit("b", None) == 2.0
    assert policy.on_exit("b", None) is None  # a third start in a row failed: give up
    assert policy.on_exit("c", None) == 1.0 and policy.on_exit("c", 5.0) == 2.0
    assert policy.start_failures("c") == 0  # a start that reached ready resets the count


def test_bound_ports_pin_what_the_first_start_bound():
    from services.config.roles import DecodeConfig, RouterConfig

    ready = {"grpc": "127.0.0.1:41234", "metrics": "http://127.0.0.1:41235/metrics"}
    worker = bound_ports(DecodeConfig(port=0, metrics_port=0), ready)
    assert (worker.port, worker.metrics_port) == (41234, 41235)
    router = bound_ports(
        RouterConfig(port=0, http_port=0), {**ready, "http": "http://127.0.0.1:8001"}
    )
    assert (router.port, router.metrics_port, router.http_port) == (41234, 41235, 8001)


def test_a_restarted_worker_is_a_new_engine():
    from services.cluster.restarts import new_engine_identity
    from services.config.roles import DecodeConfig, RouterConfig
    from services.engine.config import EngineConfig

    worker = DecodeConfig(engine=EngineConfig(engine_id="decode-0-0123456789ab"))
    restarted = new_engine_identity(worker)
    assert restarted.engine.engine_id.startswith("decode-0-")
    assert restarted.engine.engine_id != worker.engine.engine_id
    assert len(restarted.engine.engine_id) == len(worker.engine.engine_id)
    assert dataclasses.replace(restarted, engine=worker.engine) == worker  # nothing else moved
    named = new_engine_identity(DecodeConfig(engine=EngineConfig(engine_id="mine")))
    assert named.engine.engine_id.startswith("mine-")
    assert new_engine_identity(RouterConfig()) == RouterConfig()
