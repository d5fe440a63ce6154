"""Shared fixtures: tiny random-weight model folders, the default model, the tie-ratio gate."""

from __future__ import annotations

import logging
import os
from pathlib import Path

# Triton kernels run in Triton's CPU interpreter here (the Triton attention backend's CPU tests).
# Triton reads this when triton.language is first imported, which importing torch may do, so
# it is set before anything else; scripts/gpu_check.sh sets it to 0 to compile for the GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests import reference

# Weights drawn with a large init range so greedy choices are decisive (ties stay rare).
TINY_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)


def make_tiny_model(kind: str, folder: Path, **overrides) -> Path:
    """Save a random-weight llama/qwen2 model to `folder` (seeded, so identical every run)."""
    torch.manual_seed(1234)
    if kind == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(**{**TINY_COMMON, "num_key_value_heads": 2, **overrides})
        )
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(**{**TINY_COMMON, "num_key_value_heads": 1, **overrides})
        )
    else:
        raise ValueError(kind)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tmp_path_factory) -> str:
    return str(make_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}")))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama-only")))


@pytest.fixture(scope="session")
def default_model() -> str:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, cached)."""
    from services.engine.loader import resolve_model

    return str(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def real_text_ids(default_model) -> list[int]:
    """~20k token ids of real text (stdlib source), for prompts of any length up to that."""
    import argparse  # noqa: E401 - text sources
    import inspect as insp
    import json as js
    import logging
    import typing

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    text = "\n".join(insp.getsource(m) for m in (argparse, logging, typing, js.decoder, insp))
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 8200, len(ids)
    return ids


def pytest_sessionfinish(session, exitstatus):
    # Tests SIGKILL workers: remove the shared-memory KV segments they could not (as the next
    # worker to start would).
    from services.kv_transfer.shared_memory.segment import sweep_dead_segments

    sweep_dead_segments()
    early, total = reference.inconclusive_ratio()
    if total and early / total > 0.10:
        print(
            f"\nEQUIVALENCE INCONCLUSIVE: {early}/{total} cases ended at a tie before half "
            "their tokens"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif total:
        print(f"\nequivalence: {total} cases compared, {early} ended at an early tie")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server():
    """A real Redis server (see tests/redis_server.py), stopped at the end of the session."""
    from tests.redis_server import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def restore_logging():
    """What `logs.configure` (or a `cli.main` call) changes on the root logger, put back
    afterwards: handlers it added are closed and removed, the earlier ones and level restored."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        if handler not in handlers:
            handler.close()
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
