"""Decode worker process: a gRPC adapter around an engine in DECODE role.

Each Decode call names a prefill worker's KV handle; the engine allocates local blocks, pulls the
prompt KV over gRPC (in chunks of at most 4 MiB), releases the prefill pin, joins the running
batch and streams one token per step. A cancelled call aborts the request and frees its blocks
at once (and, if the KV never landed, tells the prefill worker to unpin).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading

from services.common.convert import handle_from_proto, logprobs_to_proto, sampling_from_proto
from services.common.engine_loop import EngineLoop, ShuttingDownError
from services.common.errors import ServiceUnavailableError
from services.common.kv_transfer_grpc import GrpcKVTransfer
from services.common.pb import worker_pb2, worker_pb2_grpc
from services.common.server import start_service, wait_for_termination
from services.common.worker import AdminServicer, cache_salt, engine_config, next_output, worker_info
from services.engine import Engine, EngineRole
from services.engine.errors import InvalidRequestError, KVTransferError

logger = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, transfer: GrpcKVTransfer) -> None:
        self.loop = loop
        self.transfer = transfer
        self.draining = threading.Event()  # set on SIGTERM: new requests are refused
        self.num_streams = 0  # Decode calls in progress
        self._lock = threading.Lock()

    def Decode(self, request, context):
        if self.draining.is_set():
            raise ServiceUnavailableError("this decode worker is draining (SIGTERM): send the request elsewhere")
        with self._lock:
            self.num_streams += 1
        try:
            yield from self._decode(request, context)
        finally:
            with self._lock:
                self.num_streams -= 1

    def _decode(self, request, context):
        if not request.request_id or not request.HasField("kv_handle"):
            raise InvalidRequestError("kv_handle", "a decode request needs request_id and the prefill's kv_handle")
        handle, source = handle_from_proto(request.kv_handle)
        params = sampling_from_proto(request.sampling)
        prompt_ids, salt = list(request.prompt_token_ids), cache_salt(request.cache_salt)
        self.transfer.set_source(request.request_id, source)
        try:  # pull on this RPC thread, skipping what the prefix cache holds: the engine thread
            # keeps stepping the running batch meanwhile
            self.transfer.prefetch(handle, self.loop.call(lambda: self.loop.engine.cached_prefix_blocks(prompt_ids, salt)))
            stream = self.loop.submit(request.request_id, prompt_ids, params, kv_handle=handle, cache_salt=salt)
        except BaseException as exc:
            self.transfer.discard(request.request_id)  # the router releases the prefill's pin
            if isinstance(exc, KVTransferError):
                raise ServiceUnavailableError(f"prompt KV of {request.request_id!r}: {exc}") from exc
            raise
        try:
            while (out := next_output(stream, context)) is not None:
                if out.finish_reason == "error":
                    raise ServiceUnavailableError(f"prompt KV of {request.request_id!r} could not be pulled from {source}")
                yield worker_pb2.DecodeResponse(
                    # A request that ended at admission has only the prefill's first token: none new.
                    token_ids=out.new_token_ids if len(out.output_token_ids) > 1 else [],
                    finish_reason=out.finish_reason if out.finished else "",
                    kv_transfer_seconds=self.transfer.pull_seconds.pop(request.request_id, 0.0),
                    num_cached_tokens=out.num_cached_tokens,
                    logprobs=[logprobs_to_proto(lp) for lp in out.new_logprobs],
                )
                if out.finished:
                    return
        finally:
            self.transfer.discard(request.request_id)
            self.transfer.pull_seconds.pop(request.request_id, None)
            with contextlib.suppress(ShuttingDownError):  # the engine is gone: nothing to free
                self.loop.abort(request.request_id)  # no-op once finished; frees blocks on cancel

    def GetInfo(self, request, context):
        return worker_info(self.loop, "decode")


def serve(args: argparse.Namespace) -> None:
    """Start the decode worker, print its ready line, block until SIGINT/SIGTERM."""
    transfer = GrpcKVTransfer("decode", timeout_s=args.kv_transfer_timeout, zero_block=args.debug_zero_kv_block)
    engine = Engine(engine_config(args, EngineRole.DECODE), transfer)
    loop = EngineLoop(engine, "decode")
    decode = DecodeServicer(loop, transfer)
    service = start_service(
        "decode", [(worker_pb2_grpc.add_DecodeServicer_to_server, decode, "pdserve.v1.Decode"),
                   (worker_pb2_grpc.add_AdminServicer_to_server, AdminServicer(loop), "pdserve.v1.Admin")],
        args.host, args.port, args.metrics_port,
        max_workers=args.max_num_seqs + 64,  # every running request holds one streaming RPC
    )
    loop.start()
    print(service.ready_line(engine_id=engine.config.engine_id), flush=True)
    wait_for_termination(service, on_stop=loop.stop, draining=decode.draining,
                         drained=lambda: decode.num_streams == 0, drain_timeout=args.drain_timeout)
