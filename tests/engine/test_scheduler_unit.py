"""The Scheduler on its own (no model): hand-built requests, a tiny KV cache, fake sampled ids."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.kv_cache import KVCache, KVCacheSpec
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
SPEC = KVCacheSpec(
    num_layers=2, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, dtype=torch.float32
)
FIRST_TOKEN = 100  # a request's n-th sampled token is FIRST_TOKEN + n (unless a step says else)


def make_scheduler(
    num_blocks: int = 16, *, prefix_caching: bool = False, **config: int
) -> Scheduler:
    kv_cache = KVCache(
        SPEC, num_blocks, "cpu", model_id="unit-test-model" if prefix_caching else None
    )
    engine_config = EngineConfig(
        model="unused", block_size=BLOCK_SIZE, **{"max_model_len": 64, **config}
    )
    return Scheduler(engine_config, kv_cache)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 16, **kwargs) -> Request:
    eos_token_id = kwargs.pop("eos_token_id", None)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)
    return Request(request_id, list(prompt), params, seed=0, eos_token_id=eos_token_id)


class Driver:
    """Runs scheduler steps the way `Engine.step` does, with `sampled` standing in for the
    model runner: a token for every scheduled request with a sampling row, then the finished
    requests taken out (blocks freed) and the pool's integrity checked."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []

    def add(self, request: Request) -> Request:
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request

    def step(self, tokens: dict[str, int] | None = None) -> SchedulerOutput:
        out = self.scheduler.schedule()
        sampled = {
            s.request_id: (tokens or {}).get(
                s.request_id, FIRST_TOKEN + self.requests[s.request_id].num_output_tokens
            )
            for s in out.scheduled
            if s.sample is not None
        }
        got_token = self.scheduler.update(out, sampled, {}, self.requests)
        assert [r.request_id for r in got_token] == list(sampled)
        for request in got_token:
            if request.status.is_finished:
                self.scheduler.remove_running(request)
                del self.requests[request.request_id]
                self.finished.append(request)
        self.scheduler.kv_cache.pool.check_integrity()
        return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, number of tokens) per scheduled request, in schedule order."""
    return [(s.request_id, len(s.token_ids)) for s in out.scheduled]


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_prompts_are_computed_whole_then_one_token_per_step():
    driver = Driver(make_scheduler())
    a = driver.add(make_request("a", [10, 11, 12, 13, 14]))
    driver.add(make_request("b", [20, 21, 22]))
    out = driver.step()
    first_a, first_b = out.scheduled
    assert (first_a.request_id, first_a.token_ids, first_a.start_position) == (
        "a",
        [10, 11, 12, 13, 14],
        0,
    )
    assert (first_b.request_id, first_b.token_ids, first_b.start_position) == ("b", [20, 21, 22], 0)
    assert (first_a.block_table, first_b.block_table) == ([0, 1], [2])  # ceil(5/4), ceil(3/4)
    assert first_a.sample is not None and first_a.sample.output_index == 0
    assert out.preempted_ids == [] and out.num_scheduled_tokens == 8
    assert a.output_token_ids == [100] and a.num_computed_tokens == 5
    out = driver.step()
    assert [(s.request_id, s.token_ids, s.start_position) for s in out.scheduled] == [
        ("a", [100], 5),
        ("b", [100], 3),
    ]
    assert [s.sample.output_index for s in out.scheduled] == [1, 1]
    out = driver.step()
    assert [(s.token_ids, s.start_position, s.block_table) for s in out.scheduled] == [
        ([101], 6, [0, 1]),
        ([101], 4, [2, 3]),  # position 4 opens b's second block
    ]
    assert driver.scheduler.kv_cache.pool.num_free_blocks == 12


def test_a_long_prompt_is_chunked_under_max_num_batched_tokens():
    driver = Driver(make_scheduler(max_num_batched_tokens=8))
    prompt = list(range(30, 50))  # 20 tokens
    request = driver.add(make_request("long", prompt))
    chunks = []
    for _ in range(4):
        (item,) = driver.step().scheduled
        chunks.append((item.token_ids, item.start_position, item.block_table, item.sample is None))
    assert (
        chunks
        == [
            (prompt[0:8], 0, [0, 1], True),  # no token sampled while prompt tokens are left
            (prompt[8:16], 8, [0, 1, 2, 3], True),
            (prompt[16:20], 16, [0, 1, 2, 3, 4], False),
            ([100], 20, [0, 1, 2, 3, 4, 5], False),  # position 20 opens a sixth block
        ]
    )
    assert request.output_token_ids == [100, 101] and request.num_computed_tokens == 21
    assert driver.scheduler.num_prompt_tokens_computed == 20


def test_several_prompts_are_packed_into_one_step_and_the_last_one_chunked():
    driver = Driver(make_scheduler(max_num_batched_tokens=10))
    for request_id, n in (("r0", 4), ("r1", 3), ("r2", 5)):
        driver.add(make_request(request_id, list(range(2, 2 + n))))
    out = driver.step()
    assert plan(out) == [("r0", 4), ("r1", 3), ("r2", 3)]
    assert [s.sample is None for s in out.scheduled] == [False, False, True]
    out = driver.step()
    assert plan(out) == [("r0", 1), ("r1", 1), ("r2", 2)]
    assert (out.scheduled[2].token_ids, out.scheduled[2].start_position) == ([5, 6], 3)
    assert [r.output_token_ids for r in driver.requests.values()] == [[100, 101], [100, 101], [100]]


def test_decode_tokens_come_first_and_prompts_take_what_is_left_of_the_budget():
    driver = Driver(make_scheduler(max_num_batched_tokens=8))
    driver.add(make_request("d", [1, 2, 3]))
    assert plan(driver.step()) == [("d", 3)]
    driver.add(make_request("p1", list(range(10, 20))))  # 10 tokens
    driver.add(make_request("p2", [5, 6, 7, 8]))
    out = driver.step()
    assert plan(out) == [("d", 1), ("p1", 7)]  # the budget is spent: p2 waits
    assert ids(driver.scheduler.waiting) == ["p2"]
    out = driver.step()
    assert plan(out) == [("d", 1), ("p1", 3), ("p2", 4)]
    assert (out.scheduled[1].token_ids, out.scheduled[1].start_position) == ([17, 18, 19], 7)
    assert plan(driver.step()) == [("d", 1), ("p1", 1), ("p2", 1)]


def test_max_num_seqs_caps_the_running_batch():
    driver = Driver(make_scheduler(max_num_seqs=2))
    driver.add(make_request("r0", [1, 2], max_tokens=1))
    driver.add(make_request("r1", [3, 4]))
    driver.add(make_request("r2", [5, 6]))
    assert plan(driver.step()) == [("r0", 2), ("r1", 2)]
    assert ids(driver.finished) == ["r0"] and ids(driver.scheduler.waiting) == ["r2"]
    assert plan(driver.step()) == [("r1", 1), ("r2", 2)]  # r0's slot went to r2
    assert driver.scheduler.num_running == 2 and driver.scheduler.num_waiting == 0


def test_admission_is_first_come_first_served_even_when_a_later_request_would_fit():
    """A waiting request that cannot get its blocks holds back the ones behind it, so a long
    prompt is never starved by a stream of short ones."""
    driver = Driver(make_scheduler(num_blocks=4))
    driver.add(make_request("r0", list(range(10, 18)), eos_token_id=7))  # 2 blocks
    assert plan(driver.step()) == [("r0", 8)]
    driver.add(make_request("big", list(range(20, 32))))  # 3 blocks
    driver.add(make_request("small", [40, 41]))  # 1 block: it would fit
    out = driver.step()
    assert plan(out) == [("r0", 1)] and out.scheduled[0].block_table == [0, 1, 2]
    assert ids(driver.scheduler.waiting) == ["big", "small"]
    assert driver.scheduler.kv_cache.pool.num_free_blocks == 1
    out = driver.step({"r0": 7})  # EOS: r0 ends and frees its 3 blocks
    assert plan(out) == [("r0", 1)] and ids(driver.finished) == ["r0"]
    assert driver.scheduler.kv_cache.pool.num_free_blocks == 4
    assert plan(driver.step()) == [("big", 12), ("small", 2)]


def test_preemption_recomputes_the_newest_running_request_keeping_its_tokens():
    driver = Driver(make_scheduler(num_blocks=3))
    old = driver.add(make_request("old", [1, 2, 3, 4], max_tokens=2))  # 1 block
    new = driver.add(make_request("new", [5, 6, 7, 8, 9, 10]))  # 2 blocks: the pool is full
    assert plan(driver.step()) == [("old", 4), ("new", 6)]
    driver.add(make_request("later", [11]))
    out = driver.step()  # old's 5th token needs a block: the newest request gives its up
    assert out.preempted_ids == ["new"] and driver.scheduler.num_preemptions == 1
    assert plan(out) == [("old", 1)] and out.scheduled[0].block_table == [0, 2]
    assert ids(driver.scheduler.waiting) == ["new", "later"]  # no admission in this step
    assert (new.status, new.num_computed_tokens, new.block_table) == (RequestStatus.WAITING, 0, [])
    assert new.output_token_ids == [100]
    assert ids(driver.finished) == ["old"] and old.output_token_ids == [100, 101]
    out = driver.step()
    item = out.scheduled[0]
    assert plan(out) == [("new", 7), ("later", 1)]
    assert (item.token_ids, item.start_position) == ([5, 6, 7, 8, 9, 10, 100], 0)
    assert item.sample is not None and item.sample.output_index == 1
    assert new.output_token_ids == [100, 101] and new.num_computed_tokens == 7
    assert driver.scheduler.num_prompt_tokens_computed == 4 + 6 + 6 + 1  # new's prompt twice


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    driver = Driver(make_scheduler(num_blocks=3))
    driver.add(make_request("old", [1, 2], max_tokens=2))  # 1 block, room up to position 3
    new = driver.add(make_request("new", list(range(10, 18))))  # 2 blocks: the pool is full
    assert plan(driver.step()) == [("old", 2), ("new", 8)]
    out = driver.step()  # new's position 8 needs a third block, and new is the newest
    assert out.preempted_ids == ["new"] and plan(out) == [("old", 1)]
    assert ids(driver.scheduler.waiting) == ["new"] and ids(driver.finished) == ["old"]
    assert driver.scheduler.kv_cache.pool.num_free_blocks == 3
    (item,) = driver.step().scheduled  # recomputed from position 0, with its generated token
    assert (item.token_ids, item.start_position) == ([*range(10, 18), 100], 0)
    assert len(item.block_table) == 3 and new.output_token_ids == [100, 101]


def test_finishing_on_max_tokens_gives_every_block_back():
    scheduler = make_scheduler(num_blocks=8)
    driver = Driver(scheduler)
    request = driver.add(make_request("r", list(range(1, 8)), max_tokens=3))  # 7 tokens
    driver.step()
    assert scheduler.kv_cache.pool.num_free_blocks == 6
    driver.step()
    assert request.status == RequestStatus.RUNNING
    assert scheduler.kv_cache.pool.num_free_blocks == 6
    driver.step()  # the third token: length
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.status.finish_reason == "length"
    assert request.output_token_ids == [100, 101, 102] and request.block_table == []
    assert scheduler.kv_cache.pool.num_free_blocks == 8 and scheduler.num_running == 0
    assert driver.step().scheduled == []


def test_finishing_on_eos_unless_ignore_eos_and_on_stop_token_ids():
    scheduler = make_scheduler(num_blocks=8)
    driver = Driver(scheduler)
    eos = driver.add(make_request("eos", [1, 2, 3], eos_token_id=2))
    ignore = driver.add(make_request("ignore", [4, 5], eos_token_id=2, ignore_eos=True))
    stop = driver.add(make_request("stop", [6], stop_token_ids=(9,)))
    driver.step({"eos": 50, "ignore": 2, "stop": 50})
    assert [r.status for r in (eos, ignore, stop)] == [RequestStatus.RUNNING] * 3
    driver.step({"eos": 2, "ignore": 2, "stop": 9})
    assert (eos.status, stop.status) == (RequestStatus.FINISHED_STOPPED,) * 2
    assert eos.status.finish_reason == "stop" and eos.output_token_ids == [50, 2]
    assert ignore.status == RequestStatus.RUNNING and ignore.output_token_ids == [2, 2]
    assert ids(driver.finished) == ["eos", "stop"] and ids(scheduler.running) == ["ignore"]
    assert scheduler.kv_cache.pool.num_free_blocks == 7  # only ignore's one block is held


def test_max_model_len_finishes_with_length():
    driver = Driver(make_scheduler(max_model_len=6))
    request = driver.add(make_request("r", [1, 2, 3, 4], max_tokens=50))
    driver.step()
    driver.step()
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_tokens == 6


def test_prefix_cache_hit_at_admission_starts_after_the_cached_blocks():
    scheduler = make_scheduler(num_blocks=8, prefix_caching=True)
    driver = Driver(scheduler)
    shared = list(range(10, 18))  # two full blocks
    first = driver.add(make_request("first", shared + [1, 2], max_tokens=1))
    assert plan(driver.step()) == [("first", 10)]
    assert first.num_cached_tokens == 0 and ids(driver.finished) == ["first"]
    assert scheduler.kv_cache.pool.num_cached_blocks == 2  # freed, still reusable
    second = driver.add(make_request("second", shared + [3, 4, 5]))
    (item,) = driver.step().scheduled
    assert second.num_cached_tokens == 8
    assert (item.token_ids, item.start_position, item.block_table[:2]) == ([3, 4, 5], 8, [0, 1])
    assert len(item.block_table) == 3 and scheduler.kv_cache.pool.num_cached_blocks == 0
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (10 + 11, 8)
    assert second.output_token_ids == [100] and second.num_computed_tokens == 11


def test_a_prefix_hit_always_leaves_the_last_prompt_token_to_compute():
    """A prompt of exactly two cached full blocks reuses only the first: its last token's
    logits give the first output token, so the block holding it is computed again."""
    scheduler = make_scheduler(num_blocks=8, prefix_caching=True)
    driver = Driver(scheduler)
    prompt = list(range(10, 18))
    first = driver.add(make_request("first", prompt))
    assert plan(driver.step()) == [("first", 8)]
    same = driver.add(make_request("same", prompt))
    out = driver.step()
    assert plan(out) == [("first", 1), ("same", 4)]
    item = out.scheduled[1]
    assert same.num_cached_tokens == 4
    assert (item.token_ids, item.start_position) == (prompt[4:], 4)
    assert item.block_table[0] == first.block_table[0] != item.block_table[1]
    assert scheduler.kv_cache.pool.ref_count(first.block_table[0]) == 2  # shared, not copied
