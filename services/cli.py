"""`pdserve` command line.

`pdserve run` drives an in-process engine (no servers) and streams the answer; the cluster
commands (`serve`, `prefill`, `decode`, `router`, `generate`) arrive with the services.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# Kept free of torch/transformers imports so `pdserve --help` answers at once.
DEFAULT_MODEL = "smollm2-135m-instruct"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="pdserve: disaggregated prefill/decode LLM serving"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="generate with an in-process engine (no servers)")
    source = run.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw prompt text")
    source.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    source.add_argument("--chat", help="one user message, formatted with the model's chat template")
    run.add_argument("--model", default=DEFAULT_MODEL)
    run.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    run.add_argument("--block-size", type=int, default=16)
    run.add_argument("--max-model-len", type=int, default=None)
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=-1)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--ignore-eos", action="store_true")
    run.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return parser


def _run(args: argparse.Namespace) -> int:
    from services.engine import Engine, EngineConfig, SamplingParams
    from services.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
    )
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size,
                                 max_model_len=args.max_model_len))
    if args.prompt_ids is not None:
        prompt: str | list[int] = _parse_ids(args.prompt_ids)
    elif args.chat is not None:
        if engine.tokenizer is None:
            raise ValueError("chat: the model folder has no tokenizer")
        messages = [{"role": "user", "content": args.chat}]
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        prompt = args.prompt
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    prompt_ids = list(engine.requests[request_id].prompt_token_ids)
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids) if engine.tokenizer else None
    first_token_time, final = None, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_time = first_token_time or time.perf_counter()
            if detok is not None:
                delta = detok.add_tokens(out.new_token_ids) + (detok.flush() if out.finished else "")
                if not args.json:
                    print(delta, end="", flush=True)
            final = out
    end = time.perf_counter()
    if args.json:
        print(json.dumps({
            "text": detok.text if detok else "",
            "token_ids": final.output_token_ids,
            "finish_reason": final.finish_reason,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(final.output_token_ids),
                      "cached_tokens": 0},
            "timings": {"ttft": first_token_time - start, "e2e": end - start},
        }))
    else:
        print()
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"prompt-ids: expected comma-separated integers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    from services.engine.errors import EngineError

    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, OSError, EngineError) as exc:  # bad flags, input or model folder: one line
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
