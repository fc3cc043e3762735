"""torch.save's file format, produced by layout instead of by `torch.save`.

A state dict becomes (a) `data.pkl`, the pickle `torch.save` would write, with every tensor
replaced by a reference to a storage record, and (b) one record per tensor.  The records are
placed once per tensor signature (dtype and shape of each tensor) so a save is only a copy into
fixed places; the tail (pickle, small records, central directory) is rebuilt per save.

Reading goes the other way: our unpickler turns the storage references into views over any
buffer (a shared-memory segment, an mmap'd file), so nothing is copied until the caller wants.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import pickle
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dlrover_hpc.checkpoint.formats.zip_archive import CRC_FIELD, ArchivePlan
from dlrover_hpc.errors import CheckpointError

ARCHIVE = "archive"
MANIFEST = f"{ARCHIVE}/.dlrover_hpc/manifest.json"
ALIGN = 64

_LEGACY = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex128: "ComplexDoubleStorage",
    torch.complex64: "ComplexFloatStorage",
}
_LEGACY_BY_NAME = {name: dtype for dtype, name in _LEGACY.items()}
_SAFE_BUILTINS = {
    ("builtins", n)
    for n in ("set", "frozenset", "complex", "slice", "range", "bytearray", "tuple", "list")
} | {("_codecs", "encode"), ("collections", "OrderedDict"), ("collections", "defaultdict")}
_SAFE_TORCH = {("torch", "Size"), ("torch", "device"), ("torch", "dtype")}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint metadata")
    return value


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


class _StorageRef:
    __slots__ = ("dtype", "key", "nbytes", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int, nbytes: int) -> None:
        self.key, self.dtype, self.numel, self.nbytes = key, dtype, numel, nbytes


class _StatePickler(pickle.Pickler):
    """Pickles like `torch.save` does, but collects tensors instead of writing their storage."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[tuple[Any, ...], _StorageRef] = {}
        self._hooks: collections.OrderedDict[Any, Any] = collections.OrderedDict()  # shared

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if obj.layout != torch.strided or obj.is_quantized or obj.is_meta:
            raise CheckpointError(
                f"cannot checkpoint a {obj.layout} tensor of dtype {obj.dtype} on {obj.device}; "
                "convert it to a dense tensor first"
            )
        shape = tuple(obj.shape)
        ident = (obj.data_ptr(), obj.dtype, shape, tuple(obj.stride()), obj.device)
        ref = self._seen.get(ident) if obj.numel() else None
        if ref is None:
            ref = _StorageRef(
                str(len(self.tensors)), obj.dtype, obj.numel(), obj.numel() * obj.element_size()
            )
            self.tensors.append(obj)
            if obj.numel():
                self._seen[ident] = ref
        hooks = self._hooks
        stride = ident[3] if obj.is_contiguous() else contiguous_stride(shape)
        if obj.dtype in _LEGACY:
            return (torch._utils._rebuild_tensor_v2, (ref, 0, shape, stride, False, hooks))
        return (torch._utils._rebuild_tensor_v3, (ref, 0, shape, stride, False, hooks, obj.dtype))

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not _StorageRef:  # called for every object: keep it cheap
            return None
        if obj.dtype in _LEGACY:
            return ("storage", getattr(torch, _LEGACY[obj.dtype]), obj.key, "cpu", obj.numel)
        return ("storage", torch.storage.UntypedStorage, obj.key, "cpu", obj.nbytes)


def pickle_state(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """`data.pkl` for `obj` and its tensors in storage-key order ("0", "1", ...)."""
    buf = io.BytesIO()
    pickler = _StatePickler(buf)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"the state dict cannot be pickled: {exc}") from exc
    return buf.getvalue(), pickler.tensors


def tensor_signature(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """Where one tensor's bytes go, relative to the start of its archive."""

    key: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tail:
    """The per-save end of an archive: bytes placed at `offset`, and the CRCs left to patch."""

    offset: int
    data: bytes
    #: [data offset, length, [CRC field offsets]] per record whose CRC the saver computes
    crc_patches: list[list[Any]]
    #: name -> (data offset, size) of the records in the tail
    records: dict[str, tuple[int, int]]


class TorchFileLayout:
    """Records of one tensor signature; `tail()` completes the archive for one save."""

    def __init__(self, tensors: Sequence[torch.Tensor], *, zip64: bool = False) -> None:
        self.signature = tensor_signature(tensors)
        self._plan = ArchivePlan(align=ALIGN, zip64=zip64)
        self.slots: list[Slot] = []
        self.headers: list[tuple[int, bytes]] = []
        for index, t in enumerate(tensors):
            nbytes = t.numel() * t.element_size()
            entry = self._plan.add(f"{ARCHIVE}/data/{index}", nbytes)
            self.headers.append((entry.header_offset, entry.header))
            self.slots.append(
                Slot(
                    key=str(index),
                    offset=entry.data_offset,
                    nbytes=nbytes,
                    dtype=t.dtype,
                    shape=tuple(t.shape),
                )
            )
        self.data_end = self._plan.size
        self._plan.freeze_prefix()

    def tail(self, data_pkl: bytes, extra: dict[str, bytes]) -> Tail:
        plan = self._plan.fork()
        small = {
            f"{ARCHIVE}/data.pkl": data_pkl,
            f"{ARCHIVE}/.format_version": b"1",
            f"{ARCHIVE}/.storage_alignment": str(ALIGN).encode(),
            f"{ARCHIVE}/byteorder": b"little",
            f"{ARCHIVE}/version": b"3\n",
            **extra,
        }
        out = bytearray()
        crcs = [0] * len(self.slots)
        records = {}
        for name, data in small.items():
            crc = zlib.crc32(data)
            entry = plan.add(name, len(data), crc)
            out += entry.header + data
            crcs.append(crc)
            records[name] = (entry.data_offset, len(data))
        central, cd_crc = plan.central(crcs)
        out += central
        patches = [
            [slot.offset, slot.nbytes, [header_at + CRC_FIELD, cd_crc[i]]]
            for i, (slot, (header_at, _)) in enumerate(zip(self.slots, self.headers, strict=True))
            if slot.nbytes
        ]
        return Tail(offset=self.data_end, data=bytes(out), crc_patches=patches, records=records)


def placed_at(
    layout: TorchFileLayout, tail: Tail, start: int
) -> tuple[list[tuple[int, bytes]], list[list[Any]]]:
    """The archive placed at `start` of a larger image: the bytes written as they are (the
    records' headers, the tail) and the CRC ranges, all at image offsets."""
    chunks = [(start + at, header) for at, header in layout.headers]
    chunks.append((start + tail.offset, tail.data))
    crc = [[start + a, n, [start + f for f in fs]] for a, n, fs in tail.crc_patches]
    return chunks, crc


def manifest_bytes(**fields: Any) -> bytes:
    return json.dumps({"format": 1, **fields}, sort_keys=True).encode()


# ----------------------------------------------------------------------------------- reading


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


Resolver = Callable[[str, torch.dtype, int], torch.Tensor]


class ViewUnpickler(pickle.Unpickler):
    """Reads a `data.pkl`; storage `key` becomes `resolve(key, dtype, numel)`, a 1-D view.

    With `weights_only` only containers, scalars, tensors and what
    `torch.serialization.add_safe_globals` allows are accepted, as in `torch.load`.
    """

    def __init__(self, data: bytes, resolve: Resolver, *, weights_only: bool = True) -> None:
        super().__init__(io.BytesIO(data))
        self._resolve = resolve
        self._weights_only = weights_only

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol-2 spelling
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return _rebuild_v2
            if name == "_rebuild_tensor_v3":
                return _rebuild_v3
            if name == "_rebuild_parameter":
                return _rebuild_parameter
        if module == "torch" and name in _LEGACY_BY_NAME:
            return _StorageType(_LEGACY_BY_NAME[name])
        if module == "torch.storage" and name == "UntypedStorage":
            return _StorageType(torch.uint8)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if not self._weights_only or (module, name) in _SAFE_BUILTINS | _SAFE_TORCH:
            return super().find_class(module, name)
        for allowed in torch.serialization.get_safe_globals():
            obj = allowed[0] if isinstance(allowed, tuple) else allowed
            if getattr(obj, "__module__", None) == module and obj.__qualname__ == name:
                return obj
        raise CheckpointError(
            f"the checkpoint holds an object of type {module}.{name}, which is not allowed with "
            "weights_only=True; allow it with torch.serialization.add_safe_globals([...]) or "
            "load with weights_only=False if you trust the file"
        )

    def persistent_load(self, pid: Any) -> Any:
        try:
            kind, storage_type, key, _location, numel = pid
        except ValueError:
            raise CheckpointError(f"malformed storage reference {pid!r} in data.pkl") from None
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"unsupported storage reference {pid!r} in data.pkl")
        return self._resolve(str(key), storage_type.dtype, int(numel))


def _rebuild_v2(
    storage: torch.Tensor,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool,
    hooks: Any,
    metadata: Any = None,
) -> torch.Tensor:
    return storage.as_strided(tuple(size), tuple(stride), offset)


def _rebuild_v3(
    storage: torch.Tensor,
    offset: int,
    size: Sequence[int],
    stride: Sequence[int],
    requires_grad: bool,
    hooks: Any,
    dtype: torch.dtype,
    metadata: Any = None,
) -> torch.Tensor:
    return storage.view(dtype).as_strided(tuple(size), tuple(stride), offset)


def _rebuild_parameter(data: torch.Tensor, requires_grad: bool, hooks: Any) -> torch.Tensor:
    return data


def buffer_view(buf: Any, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A 1-D tensor of `numel` elements aliasing `buf` at byte `offset` (no copy)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)
