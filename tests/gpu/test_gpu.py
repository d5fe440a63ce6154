"""The CUDA path on a GPU (skipped without CUDA; `scripts/gpu_check.sh` runs it on a lent one).

Engine-level only, so it needs nothing beyond torch, transformers and triton (the lent machine
has no package registry): the attention backends agree with SDPA in bf16 for block sizes 16
and 256; greedy output equals transformers' on the GPU by the bf16 equivalence rule (at the
first divergence each side's token is in the other's top 5, vLLM's check_logprobs_close);
CUDA-graph decode equals eager decode by the same rule; CUDA IPC moves KV bytes exactly between
two processes; --gpu-memory-utilization bounds the cache.

Runs under pytest, or as `python tests/gpu/test_gpu.py` where pytest is not installed.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

try:
    import pytest

    pytestmark = [
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ]
except ImportError:  # the bare GPU machine: run as a script
    pytest = None  # type: ignore[assignment]

DEVICE = "cuda"
DTYPE = torch.bfloat16
_MODEL: dict[str, str] = {}


def small_llama() -> str:
    """A random-weight Llama with GQA (8 heads, 2 KV heads, head_dim 64), saved once."""
    if "path" not in _MODEL:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
            initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
        )  # fmt: skip
        folder = Path(tempfile.mkdtemp(prefix="pdserve-gpu-llama-"))
        LlamaForCausalLM(config).save_pretrained(folder)
        _MODEL["path"] = str(folder)
    return _MODEL["path"]


PROMPTS = [list(range(5, 5 + n)) for n in (7, 40, 130, 300)]
MAX_TOKENS = 24


def engine_greedy(path: str, **overrides) -> list[tuple[list[int], list[set[int]]]]:
    """(tokens, top-5 ids per step) per prompt, from one engine run of all prompts together."""
    from services.engine import EngineConfig, SamplingParams
    from services.engine.llm import LLM

    config = EngineConfig(model=path, device=DEVICE, dtype="bfloat16", num_blocks=256, **overrides)
    llm = LLM(config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params)
    return [(o.token_ids, [{t for t, _ in lp.top} for lp in o.logprobs]) for o in outs]


def hf_greedy_top5(path: str, prompt: list[int]) -> tuple[list[int], list[set[int]]]:
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


def assert_close_bf16(a, b, context: str) -> None:
    """The bf16 rule: equal until the first divergence, where each side's token is among the
    other's top 5; the comparison ends there."""
    (tokens_a, tops_a), (tokens_b, tops_b) = a, b
    for step, (x, y) in enumerate(zip(tokens_a, tokens_b, strict=True)):
        if x != y:
            assert x in tops_b[step] and y in tops_a[step], f"{context}: step {step}: {x} vs {y}"
            return


def test_backends_agree_with_sdpa_in_bf16():
    from services.engine.attention import get_attention_backend
    from services.engine.attention.self_test import self_test

    names = ["triton", "flex"]
    from services.engine.attention.flash import flash_attn_version

    if flash_attn_version() is not None:
        names.append("flash_attn")
    for block_size in (16, 256):
        for name in names:
            if name == "flash_attn" and block_size % 256:
                continue
            backend = get_attention_backend(name, DEVICE, block_size)
            error = self_test(backend, num_heads=8, num_kv_heads=2, head_dim=64,
                              block_size=block_size, dtype=DTYPE, device=DEVICE)  # fmt: skip
            print(f"  {name} block_size={block_size}: max |diff| vs SDPA {error:.3g}")


def test_greedy_equals_transformers_on_the_gpu():
    path = small_llama()
    ours = engine_greedy(path, attention_backend="triton")
    for prompt, got in zip(PROMPTS, ours, strict=True):
        assert_close_bf16(got, hf_greedy_top5(path, prompt), f"prompt of {len(prompt)}")


def test_cuda_graph_decode_equals_eager():
    path = small_llama()
    graphed = engine_greedy(path, attention_backend="triton", max_cuda_graph_batch_size=8)
    eager = engine_greedy(path, attention_backend="triton", enforce_eager=True)
    for i, (g, e) in enumerate(zip(graphed, eager, strict=True)):
        assert_close_bf16(g, e, f"graph vs eager, prompt {i}")


def _export_child(conn) -> None:
    from services.kv_transfer.cuda_ipc.export import export_cuda_kv

    torch.manual_seed(1)
    kv = torch.randn(2, 2, 16, 16, 2, 64, device=DEVICE).to(DTYPE)
    conn.send((export_cuda_kv(kv).to_json(), kv.cpu().view(torch.int16)))
    conn.recv()  # keep the cache alive until the parent has copied


def test_cuda_ipc_moves_kv_bytes_exactly_between_two_processes():
    from services.kv_transfer.cuda_ipc.export import CudaIpcExport, open_cuda_kv

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export_child, args=(child,))
    proc.start()
    try:
        text, expected = parent.recv()
        export = CudaIpcExport.from_json(text)
        assert export.owner_pid == proc.pid
        mapped = open_cuda_kv(export, torch.device(DEVICE, 0))
        blocks = torch.tensor([3, 0, 15, 7], device=DEVICE)
        local = torch.empty(2, 2, 4, 16, 2, 64, dtype=DTYPE, device=DEVICE)
        torch.index_select(mapped, 2, blocks, out=local)
        torch.cuda.synchronize()
        want = expected.view(DTYPE)[:, :, blocks.cpu()]
        assert torch.equal(local.cpu().view(torch.int16), want.view(torch.int16))
        parent.send("done")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_gpu_memory_utilization_bounds_the_kv_cache():
    from services.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=small_llama(), device=DEVICE, gpu_memory_utilization=0.3))
    total = torch.cuda.get_device_properties(0).total_memory
    cache_bytes = engine.kv_cache.num_blocks * engine.kv_cache.spec.bytes_per_block
    assert 0 < cache_bytes <= 0.3 * total
    print(f"  KV cache at 0.3 of {total / 2**30:.0f} GiB: {cache_bytes / 2**30:.1f} GiB")


if __name__ == "__main__":
    failed = 0
    for name, test in list(globals().items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
                print(f"PASS {name}")
            except Exception as exc:  # report every test, then fail
                failed += 1
                print(f"FAIL {name}: {type(exc).__name__}: {exc}")
    sys.exit(1 if failed else 0)
