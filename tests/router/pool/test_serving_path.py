"""The serving-path decision (services/router/pool/serving_path.py) on hand-built loads and a
hand-made cost model: local or remote by predicted TTFT, the length rule without costs, the
modes, and the router's bookkeeping behind the loads (routing.py, flow/context.py)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cost_model import store
from services.cost_model.step_cost import FEATURES, StepCost, StepShape
from services.router.flow.context import FlowContext
from services.router.pool.path_calibration import (
    CALIBRATION_BOUNDS,
    CALIBRATION_DECAY_S,
    CALIBRATION_SPREAD_PRIOR,
    Z_P90,
    PathCalibration,
)
from services.router.pool.path_prediction import (
    PathLoad,
    WorkerView,
    predict_local,
    predict_remote,
    stream_delay,
)
from services.router.pool.routing import Routing
from services.router.pool.serving_path import LENDING_LOCAL_PREFILL_TOKENS, ServingPaths
from services.router.pool.worker_pool import WorkerPool


def cost(threads: int) -> StepCost:
    """5 ms a step, 1 ms per prompt token on one thread (half on two), 2 ms per decode row,
    3 us per token of context a thread reads, 4 ms more for a step with a chunk."""
    return StepCost(threads, (0.005, 0.001 / threads, 1e-7, 3e-6, 0.002, 0.004, 0.0))


COSTS = {1: cost(1), 2: cost(2)}
# one CPU of a 1 + 1 pair on a core ledger, whose streams allow 250 ms steps
LENDER = WorkerView(COSTS, threads=1, lends=True, slo_itl_s=0.25)
TIGHT = WorkerView(COSTS, threads=1, lends=True, slo_itl_s=0.05)  # streams allow 50 ms steps
AUTO = ServingPaths()


def choose(load: PathLoad, prefill: WorkerView = LENDER, decode: WorkerView = LENDER):
    return AUTO.choose(load, prefill, decode)


def test_an_idle_pair_prefills_on_the_decode_worker_which_ships_no_kv():
    choice = choose(PathLoad(256))
    assert (choice.path, choice.reason) == ("local", "predicted")
    assert choice.local_s == pytest.approx(choice.remote_s)  # both borrow the other's CPU


def test_on_borrowed_threads_a_prompt_is_predicted_in_one_step():
    """An idle pair: the prefill worker would borrow the decode worker's thread and take the
    prompt in one step on both (an owner gets its CPU back between two layers, so a borrower's
    steps have no bound); a prefill worker that does not lend runs it whole on its own."""
    both = COSTS[2].predict(StepShape(chunks=((2048, 0),)))
    assert predict_remote(LENDER, LENDER, PathLoad(2048)) == pytest.approx(both)
    alone = WorkerView(COSTS, threads=1)
    whole = COSTS[1].predict(StepShape(chunks=((2048, 0),)))
    assert predict_remote(alone, alone, PathLoad(2048)) == pytest.approx(whole)
    assert both < whole


def test_a_long_prompt_beside_streams_with_a_tight_itl_goes_to_the_prefill_pool():
    """Local chunks keep the streams' ITL objective (small chunks) and carry their rows every
    step; with a loose objective the decode worker, borrowing the idle prefill CPU, is faster."""
    load = PathLoad(2048, decode_rows=8, decode_context=8 * 300)
    choice = choose(load, decode=TIGHT)
    assert choice.path == "remote" and choice.local_s > choice.remote_s
    assert choose(load).path == "local"


def test_without_an_itl_objective_local_chunks_keep_five_decode_steps_as_the_engine_does():
    """A decode worker that sets no --slo-itl-ms (the default): the router plans its local
    chunks as its step budget will cut them, 5x the predicted decode step of its rows."""
    load = PathLoad(2048, decode_rows=8, decode_context=8 * 300)
    relative = WorkerView(COSTS, threads=1, lends=True)
    decode_s = cost(2).predict(StepShape(decode_contexts=(300,) * 8))
    explicit = WorkerView(COSTS, threads=1, lends=True, slo_itl_s=5 * decode_s)
    assert relative.slo_itl_s is None
    assert predict_local(LENDER, relative, load) == pytest.approx(
        predict_local(LENDER, explicit, load)
    )
    assert predict_local(LENDER, relative, load) > predict_local(LENDER, LENDER, load)


def test_a_stream_stating_tpot_but_no_itl_is_planned_without_an_itl_objective():
    """As the engine's `stream_itl_s`: a request stating a TPOT objective and no ITL one (llm-d's
    headers) plans local chunks by the streams' TPOT slack alone (math.inf here), its own ITL
    objective wins, and a worker's configured --slo-itl-ms stays."""
    relative = WorkerView(COSTS, threads=1, lends=True)
    assert relative.for_stream(None, None) is relative
    assert relative.for_stream(None, 0.05).slo_itl_s == math.inf
    assert relative.for_stream(0.03, 0.05).slo_itl_s == 0.03
    assert TIGHT.for_stream(None, 0.05).slo_itl_s == TIGHT.slo_itl_s
    load = PathLoad(2048, decode_rows=8, decode_context=8 * 300)
    unbounded = predict_local(LENDER, relative.for_stream(None, 0.05), load)
    assert unbounded is not None and unbounded < predict_local(LENDER, relative, load)


def test_a_busy_prefill_pool_sends_prompts_to_a_decode_worker_with_slack():
    streams = dict(decode_rows=8, decode_context=8 * 300)
    assert choose(PathLoad(512, prefill_queued=4096, **streams), decode=TIGHT).path == "local"
    assert choose(PathLoad(512, **streams), decode=TIGHT).path == "remote"


def test_a_prefix_cached_on_the_prefill_worker_keeps_the_prompt_there():
    busy = dict(decode_rows=4, decode_context=4 * 200)
    assert choose(PathLoad(1024, prefill_cached=1008, prefill_queued=300, **busy)).path == "remote"
    assert choose(PathLoad(1024, prefill_queued=300, **busy)).path == "local"


def test_a_history_cached_on_the_decode_worker_prefills_there():
    """A follow-up turn whose first 1,984 tokens the decode worker holds (it streamed the last
    turn) computes 64 tokens there; the prefill worker, which never saw it, would compute 2,048.
    Uncached, the same prompt beside the streams goes to the idle prefill pool."""
    busy = dict(decode_rows=8, decode_context=8 * 300)
    follow_up = choose(PathLoad(2048, decode_cached=1984, **busy), decode=TIGHT)
    assert follow_up.path == "local" and follow_up.local_s < follow_up.remote_s / 5
    assert choose(PathLoad(2048, **busy), decode=TIGHT).path == "remote"
    whole = predict_local(LENDER, TIGHT, PathLoad(2048, decode_cached=2048, **busy))
    assert whole > 0  # a fully cached prompt still runs its last token


def test_local_prefills_queued_on_the_decode_worker_count():
    base = PathLoad(256, decode_rows=1, decode_context=100, prefill_queued=256)
    assert choose(base).path == "local"
    assert choose(PathLoad(**{**base.__dict__, "local_queued": 4096})).path == "remote"


def test_observed_first_token_times_calibrate_the_path_they_were_predicted_for():
    """A path whose requests reach their first token later than predicted (here the remote
    path, twice as slow as fitted: a core shared with the router) is predicted slower from
    then on in the decode worker's state they were chosen in (streaming here), and the choice
    flips; the idle state keeps its own ratio; one wild observation moves the ratio by a
    bounded step."""
    load = PathLoad(512, decode_rows=1, decode_context=300, local_queued=1024)
    now = [100.0]
    calibration = PathCalibration(clock=lambda: now[0])
    first = AUTO.choose(load, LENDER, LENDER, calibration)
    assert first.path == "remote" and first.scale == 1.0 and first.streaming
    for _ in range(20):
        calibration.observe("remote", first.remote_s, 2 * first.remote_s, streaming=True)
        calibration.observe("local", first.local_s, first.local_s, streaming=True)
    assert calibration.scale("remote", streaming=True) == pytest.approx(2.0, rel=0.05)
    assert calibration.scale("local", streaming=True) == pytest.approx(1.0)
    assert calibration.scale("remote") == 1.0  # idle: not observed
    second = AUTO.choose(load, LENDER, LENDER, calibration)
    assert second.path == "local" and second.remote_s == pytest.approx(2 * first.remote_s, 0.05)
    calibration.observe("local", 0.1, 1000.0)  # clamped to the upper bound, then weighted
    assert calibration.scale("local") == pytest.approx(1 + 0.2 * (CALIBRATION_BOUNDS[1] - 1))
    calibration.observe("local", 0.0, 1.0)  # no prediction: ignored
    with pytest.raises(ValueError, match="path"):
        calibration.observe("sideways", 1.0, 1.0)
    # Unobserved, a ratio returns to 1: a path judged slow in a burst is tried again after it.
    remote = calibration.scale("remote", streaming=True)
    now[0] += CALIBRATION_DECAY_S
    assert calibration.scale("remote", streaming=True) == pytest.approx(1 + (remote - 1) / math.e)
    now[0] += 10 * CALIBRATION_DECAY_S
    assert calibration.scale("remote", streaming=True) == pytest.approx(1.0, abs=1e-4)
    assert AUTO.choose(load, LENDER, LENDER, calibration).path == "remote"


def test_without_fitted_costs_or_lending_the_length_rule_decides():
    no_costs = WorkerView(threads=1, lends=True)
    at_limit = choose(PathLoad(LENDING_LOCAL_PREFILL_TOKENS), no_costs, no_costs)
    assert (at_limit.path, at_limit.reason) == ("local", "length")
    assert choose(PathLoad(LENDING_LOCAL_PREFILL_TOKENS + 1), no_costs, no_costs).path == "remote"
    fixed = WorkerView(COSTS, threads=1, lends=False)  # a decode worker with its own CPU only
    assert (choose(PathLoad(16), fixed, fixed).path, "length") == ("remote", "length")
    assert AUTO.choose(PathLoad(16), None, None).reason == "length"  # no GetInfo answer yet
    given = ServingPaths("auto", 64)  # --max-local-prefill-tokens: the length rule, costs or not
    assert given.choose(PathLoad(64), LENDER, LENDER).path == "local"
    assert given.choose(PathLoad(65), LENDER, LENDER).reason == "length"
    assert ServingPaths("never").choose(PathLoad(9999), LENDER, LENDER).path == "local"
    assert ServingPaths("always").choose(PathLoad(1), LENDER, LENDER).reason == "mode"


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 4096),
    more=st.integers(1, 1024),
    rows=st.integers(0, 16),
    queued=st.integers(0, 4096),
)
def test_predictions_never_fall_as_work_is_added(tokens, more, rows, queued):
    load = PathLoad(tokens, decode_rows=rows, decode_context=rows * 500, prefill_queued=queued)
    bigger = PathLoad(**{**load.__dict__, "prompt_tokens": tokens + more})
    for predict in (predict_local, predict_remote):
        assert predict(LENDER, LENDER, bigger) >= predict(LENDER, LENDER, load) > 0
    more_queued = PathLoad(**{**load.__dict__, "prefill_queued": queued + more})
    assert predict_remote(LENDER, LENDER, more_queued) >= predict_remote(LENDER, LENDER, load)


def bandwidth_bound(threads: int) -> StepCost:
    """`cost` with a fixed part that scales with threads (10 ms on one, 5 ms on two), as a
    decode step bound by reading the weights does: a decode worker that loses the CPU it
    borrowed decodes slower."""
    return StepCost(threads, (0.01 / threads, 0.001 / threads, 1e-7, 3e-6, 0.002, 0.004, 0.0))


def test_within_a_ttft_objective_the_path_that_delays_the_streams_least_wins():
    """Four streams on a decode worker that borrows the idle prefill CPU; a 256-token prompt.
    Local, one 256-token chunk (on two CPUs) lengthens each stream's step; remote, the streams
    decode on one CPU instead of two while the prefill worker computes the prompt on its own:
    each loses that time x (1 - two CPUs' step / one CPU's), less than local's chunk. So under
    an objective both paths meet, remote wins (though local's TTFT is lower); under one only
    local meets, local; under none, the lower TTFT, as without an objective."""
    costs = {t: bandwidth_bound(t) for t in (1, 2)}
    view = WorkerView(costs, threads=1, lends=True, slo_itl_s=0.25)
    load = PathLoad(256, decode_rows=4, decode_context=4 * 200)
    local, remote = predict_local(view, view, load), predict_remote(view, view, load)
    assert local < remote
    delays = {p: stream_delay(p, view, view, load) for p in ("local", "remote")}
    rows = (200,) * 4
    step = {t: bandwidth_bound(t).predict(StepShape(decode_contexts=rows)) for t in (1, 2)}
    chunk = bandwidth_bound(2).predict(StepShape(chunks=((256, 0),), decode_contexts=rows))
    assert delays["local"] == pytest.approx(4 * (chunk - step[2]))
    assert local == pytest.approx(step[2] / 2 + chunk)  # the step in flight, then the chunk
    reclaim = step[2] / 2  # the prefill worker takes its CPU back after the step in flight
    assert delays["remote"] == pytest.approx(4 * (remote - reclaim) * (1 - step[2] / step[1]))
    assert 0 < delays["remote"] < delays["local"]
    loose = AUTO.choose(load, view, view, ttft_ms=1000.0)
    assert (loose.path, loose.reason) == ("remote", "objective")
    assert (loose.local_delay_s, loose.remote_delay_s) == (delays["local"], delays["remote"])
    margin = 1 + Z_P90 * CALIBRATION_SPREAD_PRIOR  # a fresh calibration's 90% bound
    assert local * margin < remote
    tight = AUTO.choose(load, view, view, ttft_ms=local * margin * 1000 * 1.01)
    assert (tight.path, tight.reason) == ("local", "objective")
    # remote predicted inside the objective but not with the margin: local, which meets it
    inside = AUTO.choose(load, view, view, ttft_ms=remote * 1000 * 1.01)
    assert (inside.path, inside.reason) == ("local", "objective")
    missed = AUTO.choose(load, view, view, ttft_ms=local / 2 * 1000)
    assert (missed.path, missed.reason) == ("local", "predicted")
    assert (AUTO.choose(load, view, view).path, AUTO.choose(load, view, view).reason) == (
        "local",
        "predicted",
    )
    by_default = ServingPaths(slo_ttft_ms=1000.0)
    assert by_default.choose(load, view, view).path == "remote"  # the router's --slo-ttft-ms
    assert by_default.choose(load, view, view, ttft_ms=remote * 1000).path == "local"


def test_the_calibration_bounds_a_path_at_90_percent_by_its_observed_spread():
    """`upper` is the mean ratio plus Z_P90 standard deviations: the prior spread before any
    observation, wider after scattered ones, narrower after steady ones, back to the prior
    without new ones. So a prompt takes a path whose prediction meets its TTFT objective only
    when the path's recent first tokens came with the room a 90% attainment needs."""
    now = [0.0]
    calibration = PathCalibration(clock=lambda: now[0])
    prior = 1 + Z_P90 * CALIBRATION_SPREAD_PRIOR
    assert calibration.upper("remote") == pytest.approx(prior)
    for _ in range(60):
        calibration.observe("local", 1.0, 1.0)  # every prediction exact
    assert calibration.scale("local") == pytest.approx(1.0)
    assert calibration.upper("local") == pytest.approx(1.0, abs=0.01)
    for i in range(60):
        calibration.observe("remote", 1.0, (0.6, 1.4)[i % 2])  # +-40% about the prediction
    assert calibration.scale("remote") == pytest.approx(1.0, abs=0.1)
    assert calibration.upper("remote") > 1 + Z_P90 * 0.3
    now[0] = 100 * CALIBRATION_DECAY_S
    assert calibration.upper("remote") == pytest.approx(prior, rel=1e-3)
    costs = {t: bandwidth_bound(t) for t in (1, 2)}
    view = WorkerView(costs, threads=1, lends=True, slo_itl_s=0.25)
    load = PathLoad(256, decode_rows=4, decode_context=4 * 200)
    remote = predict_remote(view, view, load)
    now[0] = 0.0
    steady = PathCalibration(clock=lambda: now[0])
    for _ in range(60):
        steady.observe("remote", 1.0, 1.0, streaming=True)  # the load's state: streams run
    objective_ms = remote * 1000 * 1.05  # inside the steady bound, outside the prior's
    assert AUTO.choose(load, view, view, steady, objective_ms).path == "remote"
    assert AUTO.choose(load, view, view, PathCalibration(), objective_ms).path == "local"


def test_remote_costs_the_streams_nothing_unless_the_decode_worker_was_borrowing():
    """With the prefill worker busy (its queue non-empty) the decode worker already runs on its
    own CPU: a remote prompt takes nothing from the streams, and without streams neither path
    delays anyone (local wins the tie: it ships no KV)."""
    view = WorkerView({t: bandwidth_bound(t) for t in (1, 2)}, threads=1, lends=True)
    busy = PathLoad(256, decode_rows=4, decode_context=800, prefill_queued=64)
    assert stream_delay("remote", view, view, busy) == 0.0
    assert stream_delay("local", view, view, busy) > 0.0
    assert AUTO.choose(busy, view, view, ttft_ms=10_000.0).path == "remote"
    idle = PathLoad(256)
    assert stream_delay("local", view, view, idle) == stream_delay("remote", view, view, idle) == 0
    choice = AUTO.choose(idle, view, view, ttft_ms=10_000.0)
    assert (choice.path, choice.reason) == ("local", "objective")
    fixed = WorkerView({t: bandwidth_bound(t) for t in (1, 2)}, threads=1)  # no lending
    assert stream_delay("remote", fixed, fixed, busy) == 0.0


def test_a_worker_view_reads_getinfo_and_keeps_defaults_for_what_is_missing():
    config = {
        "threads": 2,
        "core_ledger": "/dev/shm/x",
        "engine": {"max_num_batched_tokens": 512, "slo_itl_ms": 100.0, "max_num_seqs": 8},
    }
    view = WorkerView.from_info(json.dumps(config), store.to_json([cost(1), cost(2)]))
    assert (view.threads, view.lends, view.max_num_batched_tokens) == (2, True, 512)
    assert (view.slo_itl_s, view.max_num_seqs) == (0.1, 8)
    assert view.costs == COSTS and view.cost(3) == cost(2) and view.cost(2) == cost(2)
    assert WorkerView({2: cost(2)}).cost(1) == cost(2)  # none below: the smallest above
    relative = {**config, "engine": {**config["engine"], "slo_itl_ms": None}}
    assert WorkerView.from_info(json.dumps(relative), "").slo_itl_s is None  # 5 decode steps
    broken = WorkerView.from_info("{not json", '{"features": ["x"], "threads": {}}')
    assert broken == WorkerView()
    assert store.from_json("") == {} and store.to_json([]) == ""
    with pytest.raises(ValueError, match="step_costs_json"):
        store.from_json(json.dumps({"features": list(FEATURES), "threads": {"1": [1.0]}}))


def test_the_router_predicts_from_what_it_has_in_flight_and_places_local_prompts():
    """FlowContext.choose_path reads the router's own counts (queued prompt tokens, streams
    and their context, local prefills) and a local choice names the decode worker it was
    predicted on."""
    pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:3", "127.0.0.1:4"])
    pool.view = lambda address: LENDER
    routing = Routing(pool, "least_loaded")
    context = FlowContext(None, pool, routing, None, None, AUTO)  # type: ignore[arg-type]
    idle = context.choose_path(list(range(256)))
    assert idle.path == "local" and idle.decode in pool.decode
    taken = routing.pick_decode(idle.decode, 256)
    routing.local_prefill(taken, 256)
    assert (routing.in_flight[taken], routing.decode_context[taken]) == (1, 256)
    assert context.choose_path(list(range(256))).decode != taken  # the other one is idle
    other = routing.pick_decode(None, 256)
    assert other != taken
    routing.pick_prefill(list(range(8000)))  # the prefill pool is busy now
    loaded = context.choose_path(list(range(1024)))
    assert loaded.path == "local" and loaded.local_s < loaded.remote_s
    context.first_token(loaded, 3 * loaded.local_s)  # slower than predicted: calibrates
    assert context.calibration.scale("local", loaded.streaming) > 1.0
    context.first_token(ServingPaths("always").choose(PathLoad(1), None, None), 9.0)
    assert context.calibration.scale("remote") == 1.0  # a mode's choice predicts nothing
    routing.local_prefill(taken, -256)
    routing.decode_done(taken, 256)
    assert (routing.in_flight[taken], routing.decode_context[taken]) == (0, 0)
    assert ServingPaths("always").choose(PathLoad(1), None, None).path == "remote"
    objective = context.choose_path(list(range(1024)), ttft_objective_ms=1e6)
    assert objective.reason == "objective"  # the request's TTFT objective (ms) reaches the rule
    pool.close()
