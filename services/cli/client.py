"""`pdserve generate`: one streaming request to a router's Generation service; and
`pdserve reset-prefix-cache`, the operator's call to a router's (or one worker's) Admin service.

Text deltas go to stdout as they arrive; with `--json` nothing is streamed and one JSON object is
printed at the end (docs/architecture.md, "The CLI"). A gRPC error prints
`pdserve: error: CODE: details` and exits 2 for INVALID_ARGUMENT, 1 for anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services import env
from services.cli.sampling import parse_ids, sampling_params
from services.common.channels import check_address
from services.common.convert import sampling_to_proto, timings_to_dict
from services.common.pb import (
    generate_pb2,
    generate_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


@dataclass
class GenerateResult:
    """A finished stream: the joined text and ids, and what the last message carried."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" | "length" ("" if the stream ended without one)
    usage: dict[str, int] = field(
        default_factory=dict
    )  # prompt_tokens, completion_tokens, cached_tokens
    timings: dict[str, float | str] = field(default_factory=dict)  # legs in seconds, the path
    logprobs: list[dict] = field(
        default_factory=list
    )  # per token, when asked for: token_id, logprob, rank, top

    def to_json(self, with_logprobs: bool = False) -> dict:
        body = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "timings": self.timings,
        }
        return {**body, "logprobs": self.logprobs} if with_logprobs else body


def build_request(args: argparse.Namespace) -> generate_pb2.GenerateRequest:
    """GenerateRequest from the `generate` flags; ValueError naming a bad flag."""
    check_address(args.url, "--url")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    if args.seed is not None and not 0 <= args.seed < 1 << 64:
        raise ValueError(f"--seed: must be in [0, 2**64), got {args.seed}")
    sampling = sampling_to_proto(sampling_params(args), stop=args.stop)
    request = generate_pb2.GenerateRequest(
        sampling=sampling, cache_salt=getattr(args, "cache_salt", "")
    )
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids)
        if any(not -(1 << 31) <= i < 1 << 31 for i in ids):
            raise ValueError(f"prompt-ids: ids must fit in int32, got {args.prompt_ids!r}")
        request.token_ids.ids.extend(ids)
    elif args.chat is not None:
        request.chat.messages.add(role="user", content=args.chat)
    else:
        request.text = args.prompt
    return request


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """`authorization: Bearer KEY` call metadata (None without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def stream_generate(
    url: str,
    request: generate_pb2.GenerateRequest,
    timeout: float,
    on_text: Callable[[str], None] | None = None,
    api_key: str | None = None,
) -> GenerateResult:
    """Send `request` to the router at HOST:PORT, calling `on_text` with each text delta.

    `timeout` is the gRPC deadline in seconds; `api_key` goes as `authorization: Bearer KEY`
    metadata (a router started with --api-key wants it). Raises grpc.RpcError on a failed call.
    """
    result = GenerateResult()
    metadata = _auth_metadata(api_key)
    with grpc.insecure_channel(url) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for msg in stub.Generate(request, timeout=timeout, metadata=metadata):
            result.token_ids.extend(msg.token_ids)
            result.text += msg.text
            result.logprobs += [
                {
                    "token_id": lp.token_id,
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                    "top": [[t.token_id, t.logprob] for t in lp.top],
                }
                for lp in msg.logprobs
            ]
            if msg.text and on_text is not None:
                on_text(msg.text)
            if msg.finish_reason:
                result.finish_reason = msg.finish_reason
                result.usage = {
                    name: getattr(msg.usage, name)
                    for name in ("prompt_tokens", "completion_tokens", "cached_tokens")
                }
                result.timings = timings_to_dict(msg.timings)
    return result


def main(args: argparse.Namespace) -> int:
    """The `pdserve generate` command; returns the exit status."""
    request = build_request(args)
    streamed = []

    def print_delta(text: str) -> None:
        streamed.append(text)
        print(text, end="", flush=True)

    try:
        api_key = args.api_key or env.api_key()
        result = stream_generate(
            args.url, request, args.timeout, None if args.json else print_delta, api_key
        )
    except grpc.RpcError as exc:
        if streamed:
            print(flush=True)
        print(f"pdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    print(json.dumps(result.to_json(args.logprobs is not None)) if args.json else "", flush=True)
    return 0


def reset_prefix_cache(args: argparse.Namespace) -> int:
    """The `pdserve reset-prefix-cache` command: prints {"num_workers", "num_hashes_dropped"}.
    ValueError (exit 2) for a --url that is not HOST:PORT."""
    check_address(args.url, "--url")
    try:
        with grpc.insecure_channel(args.url) as channel:
            reply = worker_pb2_grpc.AdminStub(channel).ResetPrefixCache(
                worker_pb2.ResetPrefixCacheRequest(),
                timeout=args.timeout,
                metadata=_auth_metadata(args.api_key or env.api_key()),
            )
    except grpc.RpcError as exc:
        print(f"pdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {"num_workers": reply.num_workers, "num_hashes_dropped": reply.num_hashes_dropped}
        ),
        flush=True,
    )
    return 0
