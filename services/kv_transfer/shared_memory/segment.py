"""POSIX shared-memory segments holding a PREFILL engine's whole KV cache (the OS part of the
shared-memory KV transfer; `source.py` is the sender that uses it).

A segment is one file in /dev/shm (a tmpfs), created O_EXCL with mode 0600, so no other user of
the machine can map it: a 4,096-byte header page (magic, owner pid, a random 32-byte token, data
size) and then the cache's bytes. Its name is `pdserve-kv-<uid>-<pid>-<engine_id>`: per worker,
and it says whose it is. The space is reserved at creation (posix_fallocate), so a full /dev/shm
(Docker's 64 MiB default) fails there with OSError instead of a SIGBUS mid-step.

Clean-up on every exit path: the owner unlinks its segment on close and at interpreter exit; a
SIGKILLed owner cannot, so `sweep_dead_segments` (run when a worker starts, and by a receiver
whose source stopped answering) unlinks every segment of this user whose owner pid is gone, which
is how a restarted worker removes its predecessor's. A reader maps the segment read-only and
checks the token it got over the control plane: a worker on another host, or another user's
file of the same name, fails the check and the transfer takes gRPC instead.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096
MAGIC = b"PDSKV001"
_HEADER = struct.Struct("<8sQ32sQ")  # magic, owner pid, token, data bytes
_NAME = re.compile(r"pdserve-kv-(\d+)-(\d+)-[\w.-]+")


def segment_name(engine_id: str, pid: int | None = None) -> str:
    """The segment name of `engine_id` in process `pid` (default: this one)."""
    safe = re.sub(r"[^\w.-]", "_", engine_id)[:100]
    return f"pdserve-kv-{os.getuid()}-{pid or os.getpid()}-{safe}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill()
    return stat_line.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def sweep_dead_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose owner process is gone; returns their names."""
    removed = []
    uid = os.getuid()
    with contextlib.suppress(OSError):
        for path in directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match is None or int(match.group(1)) != uid or pid_alive(int(match.group(2))):
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path.name)
    if removed:
        logger.info("removed %d shared-memory KV segments of dead workers", len(removed))
    return removed


def count_segments(directory: Path = SHM_DIR) -> int:
    """This user's pdserve KV segments now in `directory` (what tests count before and after)."""
    prefix = f"pdserve-kv-{os.getuid()}-"
    with contextlib.suppress(OSError):
        return sum(1 for p in directory.iterdir() if p.name.startswith(prefix))
    return 0


class SharedSegment:
    """One mapped segment: `tensor(shape, dtype)` views its data bytes. Create with `create`
    (owner, read-write) or `open` (reader, read-only, token checked)."""

    def __init__(self, path: Path, buffer: mmap.mmap, token: bytes, nbytes: int, owner: bool):
        self.path = path
        self.token = token
        self.nbytes = nbytes
        self.owner = owner
        self._buffer = buffer  # kept alive while tensors view it; freed with the process

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def create(cls, engine_id: str, nbytes: int, directory: Path = SHM_DIR) -> SharedSegment:
        """A new segment of `nbytes` data bytes, zero-filled, for `engine_id` in this process.
        Raises OSError (no /dev/shm, not enough room in it, or the name already taken)."""
        path = directory / segment_name(engine_id)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            total = HEADER_BYTES + nbytes
            room = os.statvfs(directory)
            if room.f_bavail * room.f_frsize < total:
                raise OSError(
                    errno.ENOSPC,
                    f"{directory} has {room.f_bavail * room.f_frsize} bytes free, the KV cache "
                    f"needs {total}",
                )
            os.ftruncate(fd, total)  # pages are committed as the cache uses them
            buffer = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        os.close(fd)
        token = secrets.token_bytes(32)
        buffer[: _HEADER.size] = _HEADER.pack(MAGIC, os.getpid(), token, nbytes)
        segment = cls(path, buffer, token, nbytes, owner=True)
        atexit.register(segment.unlink)
        return segment

    @classmethod
    def open(cls, name: str, token: bytes, nbytes: int, directory: Path = SHM_DIR) -> SharedSegment:
        """Map another process's segment read-only. Raises OSError when it is missing, not
        this user's only, or its header does not carry `token` and `nbytes` (another host's
        worker, or a stale file)."""
        if _NAME.fullmatch(name) is None:
            raise OSError(f"{name!r} is not a pdserve KV segment name")
        path = directory / name
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
                raise OSError(f"{path} is not private to this user")
            if info.st_size != HEADER_BYTES + nbytes:
                raise OSError(f"{path} holds {info.st_size} bytes, not {HEADER_BYTES + nbytes}")
            buffer = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, _, their_token, their_bytes = _HEADER.unpack(buffer[: _HEADER.size])
        genuine = magic == MAGIC and secrets.compare_digest(their_token, token)
        if not genuine or their_bytes != nbytes:
            buffer.close()
            raise OSError(f"{path} is not the segment the source offered")
        return cls(path, buffer, token, nbytes, owner=False)

    @property
    def owner_pid(self) -> int:
        """The process that created the segment (from its header)."""
        return int(_HEADER.unpack(self._buffer[: _HEADER.size])[1])

    def owner_alive(self) -> bool:
        """Whether the creating process still runs. A mapping outlives its owner (the pages stay
        until the last mapping goes), so a reader checks before trusting what it copies."""
        return pid_alive(self.owner_pid)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The data bytes as a tensor of `shape` and `dtype` (read-only memory for a reader:
        copy from it, never write)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a reader's buffer is not writable
            flat = torch.frombuffer(
                self._buffer, dtype=torch.uint8, count=self.nbytes, offset=HEADER_BYTES
            )
        return flat.view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Mappings stay valid until their
        processes drop them."""
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
