"""Post-crash images of a SQLite database in WAL mode, built the way a power loss leaves them.

After a power loss the database file holds what the last checkpoint wrote (checkpoints
sync it), and the WAL file holds what was synced plus any part of what was written
after the last sync: a prefix of it, possibly ending in a torn frame, or with a hole
where a page was never written back. SQLite's recovery keeps the frames up to the last
commit frame whose salt and cumulative checksum are valid, and ignores the rest
(https://www.sqlite.org/fileformat2.html#the_write_ahead_log, "WAL File Format").

This module parses WAL frame headers (a 32-byte file header, then frames of a 24-byte
header and one page; a commit frame has a nonzero "database size after commit") and
writes such images: the WAL cut at a byte offset, or with one frame zeroed.
"""

from __future__ import annotations

import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

WAL_HEADER = 32
FRAME_HEADER = 24
_MAGIC_LE, _MAGIC_BE = 0x377F0682, 0x377F0683


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int  # where the frame header starts
    end: int  # where the next frame starts
    page: int
    commit: bool  # "database size after commit" is nonzero


def _checksum(data: bytes, s0: int, s1: int, big_endian: bool) -> tuple[int, int]:
    """SQLite's WAL checksum, continued from (s0, s1) over ``data`` (a multiple of 8 bytes)."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def valid_frames(wal: bytes) -> list[Frame]:
    """The frames SQLite's recovery would accept, in order, up to the first invalid one."""
    if len(wal) < WAL_HEADER:
        return []
    magic, _version, page_size, _ckpt, salt1, salt2, c0, c1 = struct.unpack(">8I", wal[:32])
    if magic not in (_MAGIC_LE, _MAGIC_BE):
        return []
    big_endian = magic == _MAGIC_BE
    s0, s1 = _checksum(wal[:24], 0, 0, big_endian)
    if (s0, s1) != (c0, c1):
        return []
    frames: list[Frame] = []
    offset = WAL_HEADER
    while offset + FRAME_HEADER + page_size <= len(wal):
        page, db_size, f_salt1, f_salt2, f0, f1 = struct.unpack(
            ">6I", wal[offset : offset + FRAME_HEADER]
        )
        if (f_salt1, f_salt2) != (salt1, salt2) or page == 0:
            break
        body = wal[offset + FRAME_HEADER : offset + FRAME_HEADER + page_size]
        s0, s1 = _checksum(wal[offset : offset + 8], s0, s1, big_endian)
        s0, s1 = _checksum(body, s0, s1, big_endian)
        if (s0, s1) != (f0, f1):
            break
        end = offset + FRAME_HEADER + page_size
        frames.append(Frame(offset, end, page, db_size != 0))
        offset = end
    return frames


def commit_ends(wal: bytes) -> list[int]:
    """The end offset of every valid commit frame: the WAL lengths that hold whole commits."""
    return [frame.end for frame in valid_frames(wal) if frame.commit]


def write_image(db: Path, wal: bytes, target: Path, *, cut: int, hole: Frame | None = None) -> Path:
    """A copy of ``db`` with ``wal[:cut]`` as its WAL (and ``hole`` zeroed), as a power loss
    could leave it; no -shm file (SQLite rebuilds it from the WAL). Returns the db path."""
    target.mkdir(parents=True, exist_ok=True)
    path = target / db.name
    shutil.copyfile(db, path)
    data = bytearray(wal[:cut])
    if hole is not None:
        data[hole.offset : hole.end] = bytes(hole.end - hole.offset)
    Path(f"{path}-wal").write_bytes(bytes(data))
    return path
