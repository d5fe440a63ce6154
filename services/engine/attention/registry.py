"""The attention backends by name, and the automatic choice among them."""

from __future__ import annotations

from services.engine.attention.base import AttentionBackend
from services.engine.config import ATTENTION_BACKENDS
from services.env import triton_interpret

BACKEND_NAMES = ATTENTION_BACKENDS


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend_name(name: str, device: str, block_size: int) -> str:
    """The backend "auto" stands for, or `name` itself.

    CPU: `cpu_paged` when its C++ kernel builds, else `torch_sdpa`. CUDA: `flash_attn` when it
    imports with this torch and block_size is a multiple of 256, else `triton`, else `flex`.
    """
    if name != "auto":
        return name
    if device == "cpu":
        from services.engine.kernels import load_cpu_kernels

        return "cpu_paged" if load_cpu_kernels() is not None else "torch_sdpa"
    from services.engine.attention.flash import FLASH_BLOCK_MULTIPLE, flash_attn_version

    if flash_attn_version() is not None and block_size % FLASH_BLOCK_MULTIPLE == 0:
        return "flash_attn"
    return "triton" if _triton_imports() else "flex"


def get_attention_backend(name: str, device: str, block_size: int = 16) -> AttentionBackend:
    """The backend `name` for `device` (a torch device string). Raises ValueError naming
    `attention_backend` for an unknown name or one this device cannot run (`block_size` for
    flash-attn's page-size rule)."""
    name = resolve_backend_name(name, device, block_size)
    on_cpu = device == "cpu"
    if name == "torch_sdpa":
        from services.engine.attention.sdpa import TorchSDPABackend

        return TorchSDPABackend()
    if name == "cpu_paged":
        if not on_cpu:
            raise ValueError(f"attention_backend: 'cpu_paged' runs on the CPU only, not {device!r}")
        from services.engine.attention.cpu_paged import CPUPagedBackend

        return CPUPagedBackend()
    if name == "triton":
        if not _triton_imports():
            raise ValueError("attention_backend: 'triton' needs the triton package")
        if on_cpu and not triton_interpret():
            raise ValueError(
                "attention_backend: 'triton' runs on CUDA (on the CPU only in Triton's "
                "interpreter, TRITON_INTERPRET=1, for tests)"
            )
        from services.engine.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    if name == "flex":
        from services.engine.attention.flex import FlexAttentionBackend

        return FlexAttentionBackend(device)
    if name == "flash_attn":
        if on_cpu:
            raise ValueError("attention_backend: 'flash_attn' runs on CUDA only")
        from services.engine.attention.flash import FlashAttnBackend

        return FlashAttnBackend(block_size)
    raise ValueError(f"attention_backend: unknown {name!r}, expected one of {list(BACKEND_NAMES)}")
