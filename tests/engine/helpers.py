"""Small helpers the engine tests share: build an engine, run it step by step with checks."""

from __future__ import annotations

from services.engine import Engine, EngineConfig, SamplingParams
from services.engine.outputs import RequestOutput

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(
    model: str,
    *,
    poison: bool = True,
    kv_transfer=None,
    kv_sender=None,
    kv_receiver=None,
    **config,
) -> Engine:
    """An engine (`kv_transfer`: an in-memory pair, else `kv_sender` / `kv_receiver`) with a
    shuffled free list and (by default) every free block filled with NaN,
    so a read outside a request's own blocks turns its output into garbage."""
    config = EngineConfig(model=model, shuffle_free_blocks=True, **{"seed": 0, **config})
    if kv_transfer is not None:  # an InMemoryKVTransfer: both sides in this process
        kv_sender, kv_receiver = kv_transfer.sender, kv_transfer.receiver
    engine = Engine(config, kv_sender, kv_receiver)
    if poison:
        engine.kv_cache.kv.fill_(float("nan"))
    return engine


def run_to_completion(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Add requests, step until all finish, check block integrity after every step.

    Returns ({request_id: output token ids}, steps) where steps[i] maps each request in step i's
    forward batch to the number of tokens the model computed for it.
    """
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=request_id)
    finished: dict[str, RequestOutput] = {}
    steps: list[dict[str, int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps.append(dict(engine.last_forward_tokens))
        engine.check_integrity()
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks
    return {rid: out.output_token_ids for rid, out in finished.items()}, steps
