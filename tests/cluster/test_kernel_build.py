"""`pdserve serve` builds the C++ CPU kernels before its workers start, so a first start on a
slow machine never counts a compile against a worker's start timeout
(`services/engine/kernels/cache.py`, `ClusterSpec.build_kernels`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.cluster import launcher
from services.engine.kernels import cache as kernel_cache

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_folder_is_found_without_loading_torch():
    code = (
        "import sys; from services.engine.kernels import cache; import services.cluster.launcher; "
        "cache.built(); assert 'torch' not in sys.modules, 'torch loaded'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_each_checkout_builds_in_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    here = kernel_cache.build_dir()
    assert here == kernel_cache.build_dir() and here.parent == tmp_path / "kernels"
    monkeypatch.setattr(kernel_cache, "KERNEL_DIR", tmp_path / "another" / "checkout")
    assert kernel_cache.build_dir() != here  # torch's builder records source paths


def _spec(cpu: bool) -> launcher.ClusterSpec:
    return launcher.ClusterSpec([], lambda p, d: None, cpu_kernels=cpu)  # type: ignore[arg-type,return-value]


def test_the_kernels_are_built_once_before_the_workers_and_said_so(monkeypatch):
    built, builds, said = [False], [], []

    def build() -> bool:
        builds.append(1)
        built[0] = True
        return True

    monkeypatch.setattr(kernel_cache, "built", lambda: built[0])
    monkeypatch.setattr(kernel_cache, "build", build)
    _spec(cpu=False).build_kernels(said.append)  # CUDA workers: nothing to build
    assert builds == [] and said == []
    _spec(cpu=True).build_kernels(said.append)
    assert builds == [1] and len(said) == 1 and said[0].startswith("compiling the CPU kernels")
    _spec(cpu=True).build_kernels(said.append)  # built: nothing more
    assert builds == [1] and len(said) == 1


def test_a_failed_build_leaves_the_workers_their_torch_path(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(kernel_cache, "built", lambda: False)
    monkeypatch.setattr(kernel_cache, "build", lambda: False)
    _spec(cpu=True).build_kernels(said.append)
    assert said[-1] == "the CPU kernels did not build: the workers use the pure-torch path"
