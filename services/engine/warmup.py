"""The engine's warm-up: one dummy prefill forward and one dummy decode forward before serving.

A process's first forward pays for lazy initialisation: oneDNN primitive creation, the OpenMP
thread team of the calling thread, first-call allocations, kernel JIT and autotuning on CUDA.
vLLM (`profile_run` / `capture_model`) and SGLang run a dummy batch before they report ready; a
pdserve worker runs this on its engine thread before its health turns SERVING
(`services/worker/runtime.py`), so the first real request does not pay for it.

The forwards go straight to the model runner, whatever the engine's role (PREFILL, DECODE and
BOTH run the same model), on scratch blocks borrowed from the pool (`BlockPool.borrow`), never
through the scheduler or the request queues. So they leave no trace: the blocks go back to the
free list in their order, with their bytes restored; nothing is hashed, cached or recorded as a
KV event; no request, scheduler counter or seed is touched.
"""

from __future__ import annotations

import math
import time

import torch

from services.engine.kv_cache import KVCache
from services.engine.model_runner import ModelRunner
from services.engine.sampler import SamplingRow
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledRequest, SchedulerOutput

WARM_UP_PROMPT_TOKENS = 16  # tokens of the dummy prompt (fewer when max_model_len is shorter)
_REQUEST_ID = "warm-up"  # seen by the model runner only, never by the engine's request dict
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


def warm_up(runner: ModelRunner, kv_cache: KVCache, max_model_len: int, token_id: int = 0) -> float:
    """Run a prefill forward over `WARM_UP_PROMPT_TOKENS` copies of `token_id` (at most
    max_model_len - 1 of them, at least 1), then a decode forward of one token reading that
    prompt's KV, each with greedy sampling. Returns the wall-clock seconds both took.

    Raises ResourceExhaustedError when the pool's free list lacks the few blocks needed (an
    engine that already serves: call this before serving), ValueError for a `token_id` outside
    the vocabulary.
    """
    if not 0 <= token_id < runner.vocab_size:
        raise ValueError(f"token_id: {token_id} is outside the vocabulary [0, {runner.vocab_size})")
    started = time.perf_counter()
    num_prompt = max(1, min(WARM_UP_PROMPT_TOKENS, max_model_len - 1))
    num_tokens = min(num_prompt + 1, max_model_len)  # the decode token needs one more position
    block_size = kv_cache.spec.block_size
    with kv_cache.pool.borrow(math.ceil(num_tokens / block_size)) as block_ids:
        saved = kv_cache.read_blocks(block_ids)
        # As `KVCache.allocate_slots` does: decode attention relies on unwritten slots being 0.
        kv_cache.write_blocks(block_ids, torch.zeros_like(saved))
        try:
            _forward(runner, [token_id] * num_prompt, 0, block_ids)
            if num_tokens > num_prompt:
                _forward(runner, [token_id], num_prompt, block_ids)
        finally:
            kv_cache.write_blocks(block_ids, saved)
    return time.perf_counter() - started


def _forward(runner: ModelRunner, token_ids: list[int], start: int, block_ids: list[int]) -> int:
    """One forward of `token_ids` at positions start.. of a dummy request; its sampled token."""
    row = SamplingRow(_GREEDY, seed=0, output_index=0)
    item = ScheduledRequest(_REQUEST_ID, token_ids, start, list(block_ids), row)
    return runner.execute(SchedulerOutput(scheduled=[item])).sampled[_REQUEST_ID]
