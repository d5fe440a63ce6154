"""`pdserve` command line.

`run` drives an in-process engine (no servers); `serve` starts a local cluster (router + prefill
and decode pools as processes, services/launcher.py); `prefill`, `decode` and `router` start one
service each; `generate` is a client of the router (services/client.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import asdict

# Kept free of torch/transformers/grpc imports so `pdserve --help` answers at once: every command
# imports what it needs inside its own function.
DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ["float32", "bfloat16", "float16"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: disaggregated prefill/decode LLM serving"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 - argparse's name
        return commands.add_parser(name, help=help, formatter_class=_HelpFormatter)

    _add_run(add("run", help="generate with an in-process engine (no servers)"))
    _add_serve(add("serve", help="start a local cluster: router + prefill and decode pools"))
    for role in ("prefill", "decode"):
        _add_worker(add(role, help=f"start one {role} worker"), role)
    _add_router(add("router", help="start the router (public Generate API)"))
    _add_generate(add("generate", help="send one request to a router and stream the answer"))
    reset = add(
        "reset-prefix-cache", help="forget every cached prefix (a router: on all its workers)"
    )
    reset.add_argument("--url", default="127.0.0.1:50051", help="router or worker HOST:PORT")
    reset.add_argument("--timeout", type=float, default=30.0, help="deadline in seconds")
    return parser


def _add_prompt_source(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    source.add_argument("--chat", help="one user message, formatted with the model's chat template")


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 disables")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="with --json: each token's log-probability and this many top alternatives (0..20)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")


def _add_run(run: argparse.ArgumentParser) -> None:
    _add_prompt_source(run)
    run.add_argument("--model", default=DEFAULT_MODEL)
    run.add_argument("--dtype", default=None, choices=DTYPES)
    run.add_argument("--block-size", type=int, default=16)
    run.add_argument("--max-model-len", type=int, default=None)
    run.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="most tokens in one step; longer prompts are prefilled in chunks of this size",
    )
    run.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached full blocks across requests",
    )
    _add_sampling(run)


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Engine settings shared by the workers and `serve` (which passes them on)."""
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="HF model folder or smollm2-135m-instruct"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--dtype", default=None, choices=DTYPES, help="default: float32 on CPU, bfloat16 on CUDA"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-bytes)"
    )
    parser.add_argument(
        "--kv-cache-bytes",
        dest="kv_cache_memory_bytes",
        type=int,
        default=1 << 30,
        metavar="BYTES",
        help="KV cache budget in bytes when --num-blocks is not given",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="most tokens in one step; longer prompts are prefilled in chunks of this size",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of cached full blocks across requests",
    )


def _add_listen_flags(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=port, help="gRPC port (0 picks a free one)")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: free)"
    )


def _add_worker(worker: argparse.ArgumentParser, role: str) -> None:
    _add_engine_flags(worker)
    _add_listen_flags(worker, port=0)
    worker.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: the number of --cpus, else torch's)",
    )
    worker.add_argument("--cpus", default=None, help="CPU affinity, e.g. 0,1 or 0-3")
    worker.add_argument("--engine-id", default=None, help="this engine's id (default: generated)")
    worker.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds to finish in-flight requests (new ones are refused)",
    )
    if role == "prefill":
        worker.add_argument(
            "--kv-lease-seconds",
            type=float,
            default=30.0,
            help="seconds a request's prompt KV stays pinned without a renewal from its "
            "decode worker; then its blocks are freed",
        )
        worker.add_argument(
            "--debug-kv-stall-seconds", type=float, default=0.0, help=argparse.SUPPRESS
        )
        _add_redis_flags(worker)
    else:
        worker.add_argument(
            "--kv-transfer-timeout",
            type=float,
            default=30.0,
            help="seconds a request may wait for its prompt KV (blocks, then the pull)",
        )
        worker.add_argument(
            "--max-num-waiting-for-kv",
            type=int,
            default=64,
            help="requests queued for KV blocks when the cache is full; more get "
            "RESOURCE_EXHAUSTED",
        )
        worker.add_argument("--debug-zero-kv-block", type=int, default=None, help=argparse.SUPPRESS)


def _add_router(router: argparse.ArgumentParser) -> None:
    router.add_argument(
        "--model", default=DEFAULT_MODEL, help="for the tokenizer and chat template"
    )
    _add_listen_flags(router, port=50051)
    router.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a prefill worker (repeat for each)",
    )
    router.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a decode worker (repeat for each)",
    )
    router.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    _add_routing_flags(router)
    router.add_argument(
        "--http-port", type=int, default=None, help="also serve OpenAI-compatible HTTP"
    )
    router.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's)",
    )


def _add_redis_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=None,
        help="prefix index in Redis, e.g. redis://127.0.0.1:6379/0 (default: in-process)",
    )
    parser.add_argument(
        "--index-ttl",
        type=float,
        default=10.0,
        help="seconds (> 0) a prefill worker stays in the prefix index without a heartbeat",
    )


def _add_routing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--routing",
        default="kv",
        choices=["kv", "least_loaded", "round_robin"],
        help="kv: prefix-cache overlap against load; least_loaded; round_robin",
    )
    _add_redis_flags(parser)


def _add_serve(serve: argparse.ArgumentParser) -> None:
    _add_engine_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="every service binds here")
    serve.add_argument("--port", type=int, default=50051, help="router gRPC port")
    serve.add_argument("--http-port", type=int, default=8000, help="router HTTP port")
    serve.add_argument(
        "--no-http", dest="http_port", action="store_const", const=None, help="no HTTP endpoint"
    )
    serve.add_argument("--metrics-port", type=int, default=0, help="router /metrics port (0: free)")
    serve.add_argument("--num-prefill", type=int, default=1, help="prefill workers")
    serve.add_argument("--num-decode", type=int, default=1, help="decode workers")
    for role in ("prefill", "decode"):
        serve.add_argument(
            f"--{role}-threads", type=int, default=None, help=f"--threads of each {role} worker"
        )
        serve.add_argument(
            f"--{role}-cpus", default=None, help=f"--cpus of each {role} worker, e.g. 0-3"
        )
    _add_routing_flags(serve)
    serve.add_argument(
        "--kv-lease-seconds",
        type=float,
        default=30.0,
        help="seconds prompt KV stays pinned on a prefill worker without a renewal",
    )
    serve.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="seconds a decode worker waits for a request's prompt KV (blocks, then the pull)",
    )
    serve.add_argument(
        "--max-num-waiting-for-kv",
        type=int,
        default=64,
        help="requests a decode worker queues for KV blocks; more get RESOURCE_EXHAUSTED",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds per request whose client set no deadline",
    )
    serve.add_argument(
        "--start-timeout",
        type=float,
        default=120.0,
        help="seconds each service may take to become ready",
    )


def _add_generate(generate: argparse.ArgumentParser) -> None:
    generate.add_argument("--url", default="127.0.0.1:50051", help="router HOST:PORT")
    _add_prompt_source(generate)
    _add_sampling(generate)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument(
        "--cache-salt", default="", help="share cached prefixes only with requests of this salt"
    )
    generate.add_argument(
        "--timeout", type=float, default=300.0, help="request deadline in seconds"
    )


def _run(args: argparse.Namespace) -> int:
    from services.engine import Engine, EngineConfig, SamplingParams
    from services.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    engine = Engine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching,
        )
    )
    if args.prompt_ids is not None:
        prompt: str | list[int] = parse_ids(args.prompt_ids)
    elif args.chat is not None:
        if engine.tokenizer is None:
            raise ValueError("chat: the model folder has no tokenizer")
        messages = [{"role": "user", "content": args.chat}]
        prompt = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    else:
        prompt = args.prompt
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    prompt_ids = list(engine.requests[request_id].prompt_token_ids)
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids) if engine.tokenizer else None
    first_token_time, final, logprobs = None, None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_time = first_token_time or time.perf_counter()
            logprobs += [asdict(lp) for lp in out.new_logprobs]
            if detok is not None:
                delta = detok.add_tokens(out.new_token_ids) + (
                    detok.flush() if out.finished else ""
                )
                if not args.json:
                    print(delta, end="", flush=True)
            final = out
    end = time.perf_counter()
    if args.json:
        print(
            json.dumps(
                {
                    "text": detok.text if detok else "",
                    "token_ids": final.output_token_ids,
                    "finish_reason": final.finish_reason,
                    "usage": {
                        "prompt_tokens": len(prompt_ids),
                        "completion_tokens": len(final.output_token_ids),
                        "cached_tokens": final.num_cached_tokens,
                    },
                    "timings": {"ttft": first_token_time - start, "e2e": end - start},
                    **({"logprobs": logprobs} if args.logprobs is not None else {}),
                }
            )
        )
    else:
        print()
    return 0


def parse_ids(text: str) -> list[int]:
    """`--prompt-ids 1,2,3` -> [1, 2, 3]; ValueError naming the flag."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt-ids: expected comma-separated integers, got {text!r}") from None


def _serve(args: argparse.Namespace) -> int:
    from services import launcher

    return launcher.Supervisor(launcher.cluster_spec_from_args(args)).run()


def _worker(args: argparse.Namespace) -> int:
    from services.placement import apply_cpu_placement

    # Before the server module imports torch: OpenMP sizes its pool from the affinity mask.
    apply_cpu_placement(args.threads, args.cpus)
    return _start_service(args)


def _start_service(args: argparse.Namespace) -> int:
    """`services.<role>.server.serve(args)`: prints its ready line and blocks until SIGINT/SIGTERM."""
    server = importlib.import_module(f"services.{args.command}.server")
    result = server.serve(args)
    return 0 if result is None else int(result)


def _generate(args: argparse.Namespace) -> int:
    from services import client

    return client.main(args)


def _reset_prefix_cache(args: argparse.Namespace) -> int:
    from services import client

    return client.reset_prefix_cache(args)


COMMANDS = {
    "run": _run,
    "serve": _serve,
    "prefill": _worker,
    "decode": _worker,
    "router": _start_service,
    "generate": _generate,
    "reset-prefix-cache": _reset_prefix_cache,
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Bad flags, input or model folder. An EngineError can only have been raised once its module
    was imported, so look it up instead of importing the engine (and torch) for every command."""
    errors = sys.modules.get("services.engine.errors")
    return (ValueError, OSError) + ((errors.EngineError,) if errors is not None else ())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:
        if not isinstance(exc, _user_error_types()):
            raise
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
