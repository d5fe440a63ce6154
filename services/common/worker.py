"""What the prefill and decode worker processes share: engine config from flags, info, the admin
service, waiting for outputs, and cache salts from the wire."""

from __future__ import annotations

import argparse
import queue

import grpc

from services.common.convert import layout_to_proto
from services.common.engine_loop import EngineLoop
from services.common.pb import common_pb2, worker_pb2, worker_pb2_grpc
from services.engine import EngineConfig, EngineRole
from services.engine.outputs import RequestOutput

_POLL_SECONDS = 0.05


def engine_config(args: argparse.Namespace, role: EngineRole) -> EngineConfig:
    """EngineConfig from the worker flags (ValueError names a bad field)."""
    optional = {"engine_id": args.engine_id} if getattr(args, "engine_id", None) else {}
    return EngineConfig(
        model=args.model,
        role=role,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        num_blocks=args.num_blocks,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        enable_kv_events=bool(getattr(args, "redis_url", None)),
        kv_transfer_timeout_s=getattr(args, "kv_transfer_timeout", 30.0),
        max_num_waiting_for_kv=getattr(args, "max_num_waiting_for_kv", 64),
        **optional,
    )


def worker_info(loop: EngineLoop, role: str) -> common_pb2.WorkerInfo:
    """A snapshot of the worker's engine, taken on the engine thread."""

    def snapshot() -> common_pb2.WorkerInfo:
        engine = loop.engine
        pool = engine.kv_cache.pool
        return common_pb2.WorkerInfo(
            role=role,
            engine_id=engine.config.engine_id,
            model=engine.config.model,
            kv_layout=layout_to_proto(engine.kv_cache.spec),
            max_model_len=engine.config.max_model_len,
            vocab_size=engine.runner.vocab_size,
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_pinned_blocks=engine.num_pinned_blocks,
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            num_prompt_tokens_computed=engine.scheduler.num_prompt_tokens_computed,
            max_step_tokens_per_request=loop.max_step_tokens_per_request,
            num_cached_blocks=pool.num_cached_blocks,
            model_id=engine.model_id,
        )

    return loop.call(snapshot)


class AdminServicer(worker_pb2_grpc.AdminServicer):
    """`Admin` on a worker: operator controls applied on the engine thread."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop

    def ResetPrefixCache(self, request, context):
        cleared = self.loop.call(self.loop.engine.reset_prefix_cache)
        return worker_pb2.ResetPrefixCacheResponse(num_workers=1, num_hashes_dropped=cleared)


def cache_salt(value: str) -> str | None:
    """The engine's salt for a wire `cache_salt` field (empty means none)."""
    return value or None


def next_output(stream: queue.Queue, context: grpc.ServicerContext) -> RequestOutput | None:
    """The request's next output; None once the caller has cancelled or its deadline passed.

    Raises the exception the engine loop put on the stream (a failed step).
    """
    while context.is_active():
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return None
        try:
            item = stream.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            continue
        if isinstance(item, BaseException):
            raise item
        return item
    return None
