"""GPU state at the PCIe limit: page-locked shared memory and an on-device snapshot.

Trainer side only (imports torch).  Two mechanisms:

- **Pinning.**  A `/dev/shm` mapping registered with `cudaHostRegister` is page-locked host
  memory to CUDA, so a device-to-host copy into it (and a host-to-device copy out of it) is a
  DMA at the link's speed instead of a copy staged through a driver buffer (about 5x slower on
  an H100).  Registration costs about 0.05 s per GiB of already-faulted pages and happens once
  per mapping, off the training path where it can.
- **Snapshot.**  When the GPU has room for a second copy of the state, a save copies it on the
  device (device-to-device, at TB/s) and returns; a side stream drains the snapshot into shared
  memory while training goes on.  The next save waits only if that drain is still running.

A missing CUDA or a refused registration falls back to plain copies, with one warning.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dlrover_hpc import environ
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

#: cudaHostRegisterPortable: the pages count as pinned in every CUDA context of the process
HOST_REGISTER_PORTABLE = 1
CUDA_ERROR_CUDART_UNLOADING = 4
ENV_DEVICE_SNAPSHOT = environ.CKPT_DEVICE_SNAPSHOT
#: memory the snapshot leaves free for training: this share of the GPU, and at least 1 GiB
SNAPSHOT_RESERVE_FRACTION = 0.10
SNAPSHOT_RESERVE_MIN = 1 << 30

_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(key: str, message: str, *args: Any) -> None:
    """One warning per process and kind of fallback (a job would otherwise log it per save)."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args)


def cuda_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The CUDA device of the tensors; None when none is on a GPU.

    Raises when they span several GPUs (a training process drives one).
    """
    found: torch.device | None = None
    for t in tensors:
        if t.device.type != "cuda":
            continue
        if found is None:
            found = t.device
        elif t.device != found:
            raise CheckpointError(
                f"the state dict holds tensors on {found} and on {t.device}; a checkpointer "
                "saves one process's state, which lives on one GPU (move the others first)"
            )
    return found


def target_device(target: Any) -> torch.device | None:
    """The GPU of the first CUDA tensor in a nested restore target (dicts, lists, tuples)."""
    stack = [target]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                return obj.device
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return None


# ---------------------------------------------------------------------------------- pinning


class HostPin:
    """A host address range registered with CUDA; `release()` unregisters it (idempotent)."""

    def __init__(self, address: int, size: int, device: torch.device) -> None:
        self.address = address
        self.size = size
        self.device = device
        self._lock = threading.Lock()
        self._live = True

    def release(self) -> None:
        with self._lock:
            if not self._live:
                return
            self._live = False
        try:
            with torch.cuda.device(self.device):
                err = int(torch.cuda.cudart().cudaHostUnregister(self.address))
        except RuntimeError as exc:  # CUDA already torn down (interpreter exit)
            logger.debug("checkpoint host_unregister_skipped error=%s", exc)
            return
        if err == CUDA_ERROR_CUDART_UNLOADING:  # at exit: the process's pins go with it
            return
        if err:
            logger.warning(
                "checkpoint host_unregister_failed address=%#x size=%d cuda_error=%d",
                self.address,
                self.size,
                err,
            )


def register_host(address: int, size: int, device: torch.device) -> HostPin | None:
    """Page-locks [address, address+size) for CUDA; None (warned once) when CUDA refuses."""
    if not address or not size:
        return None
    try:
        with torch.cuda.device(device):
            err = int(torch.cuda.cudart().cudaHostRegister(address, size, HOST_REGISTER_PORTABLE))
    except (RuntimeError, AttributeError) as exc:
        warn_once(
            "register",
            "checkpoint host_register_unavailable error=%s: copies between the GPU and shared "
            "memory are staged (about 5x slower); training is not affected otherwise",
            exc,
        )
        return None
    if err:
        _clear_last_error()
        warn_once(
            "register",
            "checkpoint host_register_failed size=%d cuda_error=%d: copies between the GPU and "
            "shared memory are staged (about 5x slower); check the memlock limit (ulimit -l) "
            "and that /dev/shm is not full",
            size,
            err,
        )
        return None
    return HostPin(address, size, device)


def _clear_last_error() -> None:
    """Resets this thread's CUDA runtime error after a refused registration, so torch's next
    kernel-launch check does not report it as its own failure."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((ln.split()[-1] for ln in maps if "libcudart" in ln), None)
        if path is None:
            return
        lib = ctypes.CDLL(path)  # already loaded: the same library instance torch uses
        lib.cudaGetLastError()
    except (OSError, AttributeError) as exc:
        logger.debug("checkpoint clear_cuda_error_failed error=%s", exc)


def copy_cuda(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copies (dst, src) pairs of which one side is on a GPU: all queued without waiting on the
    current stream, then one synchronisation per device (DMA when the host side is pinned)."""
    devices: set[torch.device] = set()
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
            devices.add(dst.device if dst.device.type == "cuda" else src.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


# ---------------------------------------------------------------------------------- snapshot


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotPolicy:
    """When a save may keep a second copy of the state on the GPU."""

    enabled: bool = True
    reserve_fraction: float = SNAPSHOT_RESERVE_FRACTION
    reserve_min: int = SNAPSHOT_RESERVE_MIN

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise CheckpointError(
                f"snapshot reserve_fraction={self.reserve_fraction} must be in [0, 1)"
            )

    @classmethod
    def from_env(cls, enabled: bool | None = None) -> SnapshotPolicy:
        """`enabled` wins; else environ.CKPT_DEVICE_SNAPSHOT (0/false/off disables)."""
        if enabled is None:
            raw = os.environ.get(ENV_DEVICE_SNAPSHOT, "1").strip().lower()
            if raw not in {"0", "1", "true", "false", "on", "off", "yes", "no", ""}:
                raise CheckpointError(
                    f"{ENV_DEVICE_SNAPSHOT}={raw!r} is not a switch; use 1 (on, the default) "
                    "or 0 (off)"
                )
            enabled = raw not in {"0", "false", "off", "no"}
        return cls(enabled=enabled)

    def fits(self, *, need: int, held: int, free: int, total: int) -> bool:
        """Pure decision: a snapshot of `need` bytes (of which `held` are already allocated to
        the snapshot) fits when the GPU keeps the reserve free afterwards."""
        if not self.enabled or need <= 0:
            return False
        reserve = max(self.reserve_min, int(total * self.reserve_fraction))
        return free + held - need >= reserve


class DeviceSnapshot:
    """A second copy of the GPU tensors of a state dict, on the same GPU, and its drain."""

    def __init__(self, device: torch.device, policy: SnapshotPolicy) -> None:
        self.device = device
        self.policy = policy
        self._flat: torch.Tensor | None = None
        self._signature: tuple[Any, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._groups: list[tuple[list[torch.Tensor], list[int]]] = []
        self._stream = torch.cuda.Stream(device)
        self._taken = torch.cuda.Event()

    @property
    def held_bytes(self) -> int:
        return 0 if self._flat is None else self._flat.numel()

    def fits(self, tensors: Sequence[torch.Tensor], signature: tuple[Any, ...]) -> bool:
        if signature == self._signature:  # the buffer laid out for exactly these tensors
            return self.policy.enabled
        need = _packed_size(tensors)
        if self._flat is not None and need <= self._flat.numel():
            return self.policy.enabled
        free, total = torch.cuda.mem_get_info(self.device)
        return self.policy.fits(need=need, held=self.held_bytes, free=free, total=total)

    def take(
        self, tensors: Sequence[torch.Tensor], signature: tuple[Any, ...]
    ) -> list[torch.Tensor]:
        """Copies `tensors` (GPU tensors of that dtype and shape signature) into the snapshot
        on the current stream, without waiting; returns the snapshot's views, one per tensor."""
        if signature != self._signature:
            self._layout(tensors, signature)
        with torch.no_grad():
            for views, index in self._groups:
                srcs = [tensors[i] for i in index]
                if hasattr(torch, "_foreach_copy_"):
                    torch._foreach_copy_(views, srcs)
                else:  # older torch: one launch per tensor
                    for dst, src in zip(views, srcs, strict=True):
                        dst.copy_(src)
        self._taken.record(torch.cuda.current_stream(self.device))
        return self._views

    def _layout(self, tensors: Sequence[torch.Tensor], signature: tuple[Any, ...]) -> None:
        need = _packed_size(tensors)
        if self._flat is None or self._flat.numel() < need:
            self._flat = None
            self._views = []
            self._groups = []
            self._flat = torch.empty(need, dtype=torch.uint8, device=self.device)
        views, at = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            raw = self._flat[at : at + nbytes]
            views.append(raw.view(t.dtype).view(t.shape) if nbytes else t.new_empty(t.shape))
            at += _round(nbytes)
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
        for i, (t, v) in enumerate(zip(tensors, views, strict=True)):
            if t.numel():
                group = by_dtype.setdefault(t.dtype, ([], []))
                group[0].append(v)
                group[1].append(i)
        self._views = views
        self._groups = list(by_dtype.values())
        self._signature = signature

    def drain(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies (host dst, snapshot view) pairs on the side stream once the snapshot is
        taken, and waits for them (called off the training thread)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(self._taken)
            with torch.no_grad():
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
        self._stream.synchronize()

    def release(self) -> None:
        self._flat = None
        self._views = []
        self._groups = []
        self._signature = None


def _round(nbytes: int) -> int:
    return (nbytes + 255) // 256 * 256


def _packed_size(tensors: Sequence[torch.Tensor]) -> int:
    return sum(_round(t.numel() * t.element_size()) for t in tensors if t.device.type == "cuda")
