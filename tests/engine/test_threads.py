"""The engine thread's own OpenMP team: its count set per thread, its members pinned one per
CPU (services/engine/threads.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from services.engine import SamplingParams
from services.engine.threads import pin_thread_team, set_thread_threads
from tests.engine.helpers import GREEDY, make_engine, run_to_completion

CPUS = sorted(os.sched_getaffinity(0))


def _on_a_thread(fn):
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_threads_count_is_its_own_and_survives_the_paged_kernel(tiny_llama):
    """Set on one thread, the count stays there through decode steps that run the C++ kernel
    (whose first call on a thread used to reset it to torch's default), and torch's default
    on other threads is unchanged."""
    engine = make_engine(tiny_llama, num_blocks=64)
    default = torch.get_num_threads()

    def decode_with(count: int) -> int:
        set_thread_threads(count)
        engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=4, **GREEDY))
        while engine.has_unfinished_requests():
            engine.step()
        return torch.get_num_threads()

    wanted = 3 if default != 3 else 2
    assert _on_a_thread(lambda: decode_with(wanted)) == wanted
    assert torch.get_num_threads() == default
    with pytest.raises(ValueError, match="threads"):
        set_thread_threads(0)


def _stat(tid: int) -> tuple[str, int]:
    """(state, last CPU) of one of this process's threads, from /proc."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rpartition(")")[2].split()
    return fields[0], int(fields[36])


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")
def test_a_pinned_team_never_puts_two_running_members_on_one_cpu():
    """Members pinned one per CPU, sampled every millisecond while they multiply: never two
    running on one CPU, each only ever on its own; re-pinned smaller, the rest move."""
    cpus = CPUS[:2]
    found: dict[str, object] = {}

    def work() -> None:
        tids = pin_thread_team(cpus)
        if tids is None:
            pytest.skip("no C++ extension here")
        found["tids"] = tids
        found["masks"] = [sorted(os.sched_getaffinity(t)) for t in tids]
        done = threading.Event()
        seen: list[list[tuple[str, int]]] = []

        def sample() -> None:
            while not done.is_set():
                seen.append([_stat(t) for t in tids])
                time.sleep(0.001)

        sampler = threading.Thread(target=sample)
        sampler.start()
        x = torch.randn(1500, 1500)
        for _ in range(40):
            x @ x
        done.set()
        sampler.join()
        found["seen"] = seen
        one = pin_thread_team(cpus[1:])
        found["one"] = [sorted(os.sched_getaffinity(t)) for t in one]  # while they live

    _on_a_thread(work)
    assert found["masks"] == [[c] for c in cpus]
    seen = found["seen"]
    assert len(seen) >= 50
    for sample in seen:
        running = [cpu for state, cpu in sample if state == "R"]
        assert len(running) == len(set(running))
        assert all(cpu == cpus[i] for i, (_, cpu) in enumerate(sample))
    assert found["one"] == [[cpus[1]]]
    with pytest.raises(ValueError, match="cpus: need distinct CPUs"):
        pin_thread_team([cpus[0], cpus[0]])


def test_a_hook_between_layers_may_resize_the_team_mid_step(tiny_llama):
    """`Engine.between_layers`: called between every two decoder layers of each step's forward,
    on the stepping thread; a hook that shrinks the team from two threads to one mid-step (what
    core lending does when an owner reclaims its CPU) leaves greedy output as it was."""
    params = SamplingParams(max_tokens=6, **GREEDY)
    prompt = list(range(5, 60))

    def run(hook_factory):
        def body():
            set_thread_threads(2)
            engine = make_engine(tiny_llama, num_blocks=64)
            calls: list[int] = []
            engine.between_layers(hook_factory(calls))
            outs, steps = run_to_completion(engine, {"r": (prompt, params)})
            return outs["r"], calls, len(steps), len(engine.runner.model.layers)

        return _on_a_thread(body)

    baseline, _, _, _ = run(lambda calls: None)

    def shrinking(calls):
        def hook() -> None:
            calls.append(torch.get_num_threads())
            if len(calls) == 1:
                set_thread_threads(1)  # the rest of this step, and later steps, on one thread

        return hook

    tokens, calls, steps, layers = run(shrinking)
    assert layers > 1
    assert len(calls) == steps * (layers - 1)
    assert calls[0] == 2 and set(calls[1:]) == {1}
    assert tokens == baseline
