"""What the GPU tests share: a small random-weight Llama saved once, greedy runs of the engine
and of transformers on the GPU, and the bf16 equivalence rule of docs/architecture.md."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

DEVICE = "cuda"
DTYPE = torch.bfloat16
# Prompts of 7 to 300 tokens: within one block, across blocks, across Triton's key tiles.
PROMPTS = [list(range(5, 5 + n)) for n in (7, 40, 130, 300, 17)]
MAX_TOKENS = 24
# Every test module of this folder: skipped (the reason named) without CUDA.
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

Greedy = tuple[list[int], list[set[int]]]  # tokens, top-5 ids per step
_MODEL: dict[str, str] = {}


def small_llama() -> str:
    """A random-weight Llama with GQA (8 heads, 2 KV heads, head_dim 64), saved once per
    process; a wide init range keeps greedy choices decisive."""
    if "path" not in _MODEL:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
            initializer_range=0.2, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        )  # fmt: skip
        folder = Path(tempfile.mkdtemp(prefix="pdserve-gpu-llama-"))
        LlamaForCausalLM(config).save_pretrained(folder)
        _MODEL["path"] = str(folder)
    return _MODEL["path"]


def engine_llm(path: str, dtype: str = "bfloat16", **overrides: Any) -> Any:
    from services.engine import EngineConfig
    from services.engine.llm import LLM

    settings: dict[str, Any] = dict(num_blocks=256, max_num_seqs=8, max_model_len=1024)
    config = EngineConfig(model=path, device=DEVICE, dtype=dtype, **{**settings, **overrides})
    return LLM(config)


def engine_greedy(llm: Any, prompts: list[list[int]] = PROMPTS) -> list[Greedy]:
    """(tokens, top-5 ids per step) per prompt, from one engine run of all prompts together."""
    from services.engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params)
    return [(o.token_ids, [{t for t, _ in lp.top} for lp in o.logprobs]) for o in outs]


def hf_greedy_top5(path: str, prompt: list[int]) -> Greedy:
    """transformers' own greedy on the GPU in bf16 (no cache: the full sequence each step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPE).to(DEVICE).eval()
    ids = torch.tensor([prompt], device=DEVICE)
    tokens, tops = [], []
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids).logits[0, -1].float()
            tokens.append(int(logits.argmax()))
            tops.append(set(logits.topk(5).indices.tolist()))
            ids = torch.cat([ids, ids.new_tensor([[tokens[-1]]])], dim=1)
    return tokens, tops


def assert_close_bf16(a: Greedy, b: Greedy, context: str) -> int | None:
    """The bf16 rule: equal until the first divergence, where each side's token is among the
    other's top 5; the comparison ends there. Returns the divergence step (None: equal)."""
    (tokens_a, tops_a), (tokens_b, tops_b) = a, b
    for step, (x, y) in enumerate(zip(tokens_a, tokens_b, strict=True)):
        if x != y:
            assert x in tops_b[step] and y in tops_a[step], f"{context}: step {step}: {x} vs {y}"
            return step
    return None
