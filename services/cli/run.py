"""`pdserve run`: one prompt through an in-process engine, no servers (its flags are the engine
config's, less the transfer fields, plus the prompt and sampling flags)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from services.cli.sampling import add_prompt_source, add_sampling, parse_ids, sampling_params
from services.engine.config import EngineConfig
from services.flags import add_config_flags, config_from_args

# `pdserve run` has no transfer: these engine fields mean nothing there.
RUN_EXCLUDE = frozenset(
    {
        "role",
        "engine_id",
        "kv_transfer_timeout_s",
        "max_num_waiting_for_kv",
        "kv_lease_seconds",
        "seed",
    }  # `--seed` is the request's
)


def add_run(run: argparse.ArgumentParser) -> None:
    add_prompt_source(run)
    add_config_flags(run, EngineConfig, exclude=RUN_EXCLUDE)
    add_sampling(run)


def run(args: argparse.Namespace) -> int:
    """`pdserve run`: one prompt through an in-process engine (`services.engine.LLM`)."""
    from services.engine import LLM

    params = sampling_params(args)
    llm = LLM(config_from_args(args, EngineConfig))
    if args.prompt_ids is not None:
        prompt: str | list[int] = parse_ids(args.prompt_ids)
    elif args.chat is not None:
        prompt = llm.chat_prompt(args.chat)
    else:
        prompt = args.prompt
    prompt_tokens = len(llm.prompt_token_ids(prompt))
    start = time.perf_counter()
    first_token_time, final, text, logprobs = None, None, "", []
    for delta in llm.stream(prompt, params):
        first_token_time = first_token_time or time.perf_counter()
        logprobs += [asdict(lp) for lp in delta.output.new_logprobs]
        text += delta.text
        if not args.json:
            print(delta.text, end="", flush=True)
        final = delta.output
    assert final is not None and first_token_time is not None
    if not args.json:
        print()
        return 0
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(final.output_token_ids),
        "cached_tokens": final.num_cached_tokens,
    }
    timings = {"ttft": first_token_time - start, "e2e": time.perf_counter() - start}
    body = {
        "text": text,
        "token_ids": final.output_token_ids,
        "finish_reason": final.finish_reason,
        "usage": usage,
        "timings": timings,
    }
    print(json.dumps({**body, **({"logprobs": logprobs} if args.logprobs is not None else {})}))
    return 0
