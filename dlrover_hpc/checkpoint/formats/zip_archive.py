"""The ZIP container `torch.save` writes, built by offsets so it can be laid out in memory.

Only what torch's reader (miniz) and Python's `zipfile` need: stored (uncompressed) entries,
data aligned by a padding extra field (torch's "FB" field), ZIP64 where sizes or offsets need
it, and a ZIP64 end record as torch always writes.  CRC-32 fields of large entries may be left
zero and patched later by whoever streams the bytes (the saver computes them off the training
path); `patch_offsets` says where.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Sequence

from dlrover_hpc.errors import CheckpointError

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_SIG_LOCAL, _SIG_CENTRAL = 0x04034B50, 0x02014B50
_SIG_EOCD64, _SIG_LOCATOR, _SIG_EOCD = 0x06064B50, 0x07064B50, 0x06054B50
_MAX32, _MAX16 = 0xFFFFFFFF, 0xFFFF
_DOS_DATE = 0x21  # 1980-01-01
_FLAG_UTF8 = 0x0800
_PAD_ID = 0x4246  # "FB", torch's alignment field
_ZIP64_ID = 0x0001
CRC_FIELD = 14  # offset of the CRC-32 inside a local header


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One stored record; offsets are relative to the start of its archive."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    header: bytes  # the local header, padding included, CRC field as given


def local_header(name: str, size: int, crc: int, offset: int, align: int, zip64: bool) -> bytes:
    """The local header for a record at `offset` whose data starts `align`-aligned."""
    raw = name.encode()
    use64 = zip64 or size >= _MAX32
    extra = struct.pack("<HHQQ", _ZIP64_ID, 16, size, size) if use64 else b""
    fixed = _LOCAL.size + len(raw) + len(extra) + 4
    pad = (-(offset + fixed)) % align
    extra += struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
    small, version = (_MAX32, 45) if use64 else (size, 20)
    head = _LOCAL.pack(
        _SIG_LOCAL, version, _FLAG_UTF8, 0, 0, _DOS_DATE, crc, small, small, len(raw), len(extra)
    )
    return head + raw + extra


class ArchivePlan:
    """Places records one after another; `central()` then writes the directory and end."""

    def __init__(self, *, align: int = 64, zip64: bool = False) -> None:
        self._align = align
        self._zip64 = zip64
        self._pos = 0
        self.entries: list[Entry] = []
        #: directory bytes of the first entries (CRC fields zero) and their CRC field offsets
        self._prefix: tuple[int, bytes, list[int]] = (0, b"", [])

    @property
    def size(self) -> int:
        return self._pos

    def fork(self) -> ArchivePlan:
        """A copy that can grow independently (a cached layout plus this save's tail)."""
        other = ArchivePlan(align=self._align, zip64=self._zip64)
        other._pos = self._pos
        other.entries = list(self.entries)
        other._prefix = self._prefix
        return other

    def freeze_prefix(self) -> None:
        """Caches the directory entries of the records placed so far (CRCs left zero): a
        layout reused for many saves then rebuilds only the entries after them."""
        out = bytearray()
        crc_at = []
        for entry in self.entries:
            crc_at.append(len(out) + 16)
            out += self._central_entry(entry, 0)
        self._prefix = (len(self.entries), bytes(out), crc_at)

    def add(self, name: str, size: int, crc: int = 0) -> Entry:
        header = local_header(name, size, crc, self._pos, self._align, self._zip64)
        entry = Entry(
            name=name,
            header_offset=self._pos,
            data_offset=self._pos + len(header),
            size=size,
            header=header,
        )
        self.entries.append(entry)
        self._pos = entry.data_offset + size
        return entry

    def _central_entry(self, entry: Entry, crc: int) -> bytes:
        raw = entry.name.encode()
        big = self._zip64 or entry.size >= _MAX32 or entry.header_offset >= _MAX32
        extra = b""
        size32, off32 = entry.size, entry.header_offset
        if big:
            extra = struct.pack("<HHQQQ", _ZIP64_ID, 24, entry.size, entry.size, off32)
            size32 = off32 = _MAX32
        version = 45 if big else 20
        head = _CENTRAL.pack(
            _SIG_CENTRAL, version, version, _FLAG_UTF8, 0, 0, _DOS_DATE, crc,
            size32, size32, len(raw), len(extra), 0, 0, 0, 0, off32,
        )  # fmt: skip
        return head + raw + extra

    def central(self, crcs: Sequence[int]) -> tuple[bytes, list[int]]:
        """Directory + end records for all entries, placed at the current end.

        Returns the bytes and, per entry, the archive offset of its CRC field inside the
        directory (for patching).
        """
        if len(crcs) != len(self.entries):
            raise CheckpointError(f"{len(crcs)} CRCs given for {len(self.entries)} entries")
        start = self._pos
        out = bytearray()
        crc_at: list[int] = []
        cached, prefix, prefix_at = self._prefix
        if cached and not any(crcs[:cached]):
            out += prefix
            crc_at += [start + at for at in prefix_at]
        else:
            cached = 0
        for entry, crc in zip(self.entries[cached:], crcs[cached:], strict=True):
            crc_at.append(start + len(out) + 16)
            out += self._central_entry(entry, crc)
        cd_size = len(out)
        eocd64_at = start + cd_size
        n = len(self.entries)
        out += _EOCD64.pack(_SIG_EOCD64, 44, 45, 45, 0, 0, n, n, cd_size, start)
        out += _LOCATOR.pack(_SIG_LOCATOR, 0, eocd64_at, 1)
        out += _EOCD.pack(
            _SIG_EOCD, 0, 0, min(n, _MAX16), min(n, _MAX16),
            min(cd_size, _MAX32), min(start, _MAX32), 0,
        )  # fmt: skip
        return bytes(out), crc_at


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """A record found by `read_directory`: where its data is and what its CRC should be."""

    name: str
    data_offset: int
    size: int
    crc: int


def read_directory(buf: memoryview | bytes) -> dict[str, Record]:
    """Parses the central directory of a stored-only archive held in `buf`."""
    view = memoryview(buf).cast("B")
    total = len(view)
    tail = bytes(view[max(0, total - 65557) :])
    at = tail.rfind(struct.pack("<I", _SIG_EOCD))
    if at < 0:
        raise CheckpointError("not a ZIP archive: no end-of-central-directory record")
    eocd_pos = total - len(tail) + at
    _, _, _, _, n, _, cd_off, _ = _EOCD.unpack_from(view, eocd_pos)
    loc_pos = eocd_pos - _LOCATOR.size
    if loc_pos >= 0 and _LOCATOR.unpack_from(view, loc_pos)[0] == _SIG_LOCATOR:
        eocd64 = _LOCATOR.unpack_from(view, loc_pos)[2]
        fields = _EOCD64.unpack_from(view, eocd64)
        if fields[0] != _SIG_EOCD64:
            raise CheckpointError("ZIP64 locator points at no ZIP64 end record")
        n, cd_off = fields[7], fields[9]
    records: dict[str, Record] = {}
    pos = cd_off
    for _ in range(n):
        if pos + _CENTRAL.size > total:
            raise CheckpointError("ZIP central directory runs past the end of the file")
        f = _CENTRAL.unpack_from(view, pos)
        if f[0] != _SIG_CENTRAL:
            raise CheckpointError(f"bad central directory entry at offset {pos}")
        crc, size, name_len, extra_len, comment_len, offset = f[7], f[9], f[10], f[11], f[12], f[16]
        name = bytes(view[pos + 46 : pos + 46 + name_len]).decode()
        extra = bytes(view[pos + 46 + name_len : pos + 46 + name_len + extra_len])
        size, offset = _apply_zip64(extra, size, offset)
        if f[5] != 0:
            raise CheckpointError(f"record {name!r} is compressed; only stored records are read")
        lf = _LOCAL.unpack_from(view, offset)
        if lf[0] != _SIG_LOCAL:
            raise CheckpointError(f"record {name!r}: no local header at offset {offset}")
        data = offset + _LOCAL.size + lf[9] + lf[10]
        if data + size > total:
            raise CheckpointError(f"record {name!r} runs past the end of the file (truncated?)")
        records[name] = Record(name=name, data_offset=data, size=size, crc=crc)
        pos += 46 + name_len + extra_len + comment_len
    return records


def _apply_zip64(extra: bytes, size: int, offset: int) -> tuple[int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        hid, hlen = struct.unpack_from("<HH", extra, pos)
        if hid == _ZIP64_ID:
            values = list(struct.unpack_from(f"<{hlen // 8}Q", extra, pos + 4))
            if size == _MAX32:
                size = values.pop(0)  # uncompressed
                values.pop(0)  # compressed
            if offset == _MAX32:
                offset = values.pop(0)
        pos += 4 + hlen
    return size, offset


def crc32(data: memoryview | bytes, value: int = 0, *, chunk: int = 8 << 20) -> int:
    """CRC-32 of `data` in chunks (zlib releases the GIL on each chunk)."""
    view = memoryview(data).cast("B")
    for start in range(0, len(view), chunk):
        value = zlib.crc32(view[start : start + chunk], value)
    return value
