"""Writing ``.npz`` files as ``np.savez_compressed`` does, padding included at almost no cost.

grid2op pads an episode's arrays to the chronic's length (rows of NaN after the last step) and
compresses them whole in its worker processes; ours are compressed in the workers too
(``sinks._files``), where every second of compression is one the episodes wait for. A ``Padded``
array is the rows played plus how many padding rows follow: the played rows are deflated at level
1 by ISA-L (the ``isal`` package: about 7 times as fast as zlib's level 1 on grid2op's
observations, files the same size; zlib's level 1 where ``isal`` has no wheel), and the padding is
spliced in from blocks of ``2**k`` fill rows (up to about 1 MiB, repeated for longer padding)
compressed once per process. Each block is a deflate segment
of its own (no back-references before it) ending on a byte boundary, so segments concatenate
into one valid stream. The zip member's CRC-32 combines the played bytes' with the padding's,
which is computed arithmetically from the fill row's (as zlib's ``crc32_combine``), never over
the padding's bytes. ``np.load`` reads exactly the array ``np.savez_compressed`` of the whole
array would give.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

try:
    from isal import isal_zlib as _deflater
except ImportError:  # no isal wheel for this platform (see pyproject.toml): zlib, slower
    _deflater = zlib  # type: ignore[misc]

__all__ = ["Padded", "npz_bytes"]

COMPRESS_LEVEL = 1


@dataclass(frozen=True)
class Padded:
    """``head`` (the rows played) followed by ``rows - len(head)`` copies of ``fill`` (one row)."""

    head: np.ndarray
    rows: int
    fill: np.ndarray

    def full(self) -> np.ndarray:
        """The whole array."""
        out = np.empty((self.rows, *self.head.shape[1:]), dtype=self.head.dtype)
        out[: len(self.head)] = self.head
        out[len(self.head) :] = self.fill
        return out

    def map(self, f: Callable[[np.ndarray], np.ndarray]) -> Padded:
        """This array with ``f`` (a row-wise operation: a dtype cast, a column order) applied."""
        return Padded(f(self.head), self.rows, f(self.fill[np.newaxis])[0])


def npz_bytes(**arrays: np.ndarray | Padded) -> bytes:
    """What ``np.savez_compressed(path, **arrays)`` would write, as bytes.

    Built in memory so that the writers can checksum and ``fsync`` exactly what they write.
    """
    # Every member dated 1980-01-01 00:00 (zip's first date), where np.savez puts the time of
    # writing: the same episode gives the same bytes (and checksums) whenever it is written.
    dos_time, dos_date = 0, 1 << 5 | 1
    out = bytearray()
    central = bytearray()
    for key, value in arrays.items():
        name = f"{key}.npy".encode()
        parts, crc, size = _deflate(value)
        csize = sum(len(p) for p in parts)
        offset = len(out)
        # Zip64 sizes always (numpy asks zipfile for them too): an array may exceed 4 GiB.
        extra = struct.pack("<2H2Q", 1, 16, size, csize)
        out += struct.pack(
            "<4s5H3L2H", b"PK\x03\x04", 45, 0, 8, dos_time, dos_date, crc,
            0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra),
        )  # fmt: skip
        out += name + extra
        for part in parts:
            out += part
        extra = struct.pack("<2H3Q", 1, 24, size, csize, offset)
        central += struct.pack(
            "<4s6H3L5H2L", b"PK\x01\x02", 3 << 8 | 45, 45, 0, 8, dos_time, dos_date, crc,
            0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0, 0, 0, 0o600 << 16, 0xFFFFFFFF,
        )  # fmt: skip
        central += name + extra
    start = len(out)
    out += central
    end64 = len(out)
    count = len(arrays)
    out += struct.pack(
        "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(central), start
    )
    out += struct.pack("<4sLQL", b"PK\x06\x07", 0, end64, 1)
    out += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central), 0xFFFFFFFF, 0)
    return bytes(out)


def _deflate(value: np.ndarray | Padded) -> tuple[list[bytes], int, int]:
    """The raw deflate stream of ``value``'s ``.npy`` file, its CRC-32 and its length."""
    if isinstance(value, Padded):
        head, pad = value.head, value.rows - len(value.head)
        shape: tuple[int, ...] = (value.rows, *head.shape[1:])
    else:
        head, pad = np.asanyarray(value), 0
        shape = head.shape
    if not head.flags.c_contiguous:
        head = head.copy(order="C")
    header = _Bytes()
    descr = np.lib.format.dtype_to_descr(head.dtype)
    np.lib.format.write_array_header_1_0(
        header, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    compressor = _deflater.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -15)
    parts = [compressor.compress(header.data), compressor.compress(head.data)]
    crc = _deflater.crc32(head.data, _deflater.crc32(header.data))
    size = len(header.data) + head.nbytes
    if pad <= 0:
        parts.append(compressor.flush())
        return parts, crc, size
    assert isinstance(value, Padded)
    parts.append(compressor.flush(zlib.Z_SYNC_FLUSH))  # byte-aligned, not final
    fill = np.ascontiguousarray(value.fill, dtype=head.dtype).tobytes()
    top = _top(fill)
    parts += [_padding(fill, top)] * (pad >> top)
    parts += (_padding(fill, k) for k in range(top) if pad >> k & 1)
    parts.append(_FINAL)
    return parts, _combine(crc, _padding_crc(fill, pad), len(fill) * pad), size + len(fill) * pad


class _Bytes:
    """A file object collecting what ``write_array_header_1_0`` writes."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


# An empty last block, ending the stream after the padding's non-final ones.
_FINAL = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -15).flush()


def _top(fill: bytes) -> int:
    """The largest block's ``k``: about 1 MiB of rows (longer padding repeats it)."""
    return max((2**20 // max(len(fill), 1)).bit_length() - 1, 0)


@functools.lru_cache(maxsize=512)
def _padding(fill: bytes, k: int) -> bytes:
    """``2**k`` rows ``fill``: a deflate segment of its own."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)  # once per process: compress well
    return compressor.compress(fill * (1 << k)) + compressor.flush(zlib.Z_SYNC_FLUSH)


@functools.lru_cache(maxsize=4096)
def _padding_crc(fill: bytes, pad: int) -> int:
    """The CRC-32 of ``pad`` rows ``fill``."""
    crc = 0  # of nothing
    for k in range(pad.bit_length()):
        if pad >> k & 1:
            crc = _combine(crc, _rows_crc(fill, k), len(fill) << k)
    return crc


@functools.lru_cache(maxsize=1024)
def _rows_crc(fill: bytes, k: int) -> int:
    """The CRC-32 of ``2**k`` rows ``fill`` (from half as many)."""
    if k == 0:
        return zlib.crc32(fill)
    half = _rows_crc(fill, k - 1)
    return _combine(half, half, len(fill) << (k - 1))


def _combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from those of ``a`` and ``b`` and ``len(b)`` (zlib's
    ``crc32_combine``): ISA-L's where ``isal`` has it (a new padding length took about 0.5 ms
    per episode of this module's arithmetic in Python), else computed here."""
    combine = getattr(_deflater, "crc32_combine", None)
    if combine is not None:
        return int(combine(crc1, crc2, len2))
    return _multmodp(_shift(len2), crc1) ^ crc2


@functools.lru_cache(maxsize=1024)
def _shift(n: int) -> int:
    """x^(8 n) modulo the polynomial: what shifts a CRC past ``n`` bytes."""
    return _x2nmodp(n, 3)


# CRC-32 arithmetic as zlib's crc32_combine does it (polynomials modulo the CRC's, reflected),
# which Python's zlib does not expose: crc(a + b) = multmodp(x^(8 len(b)), crc(a)) ^ crc(b).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()  # x^(2^n) modulo the polynomial


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p
