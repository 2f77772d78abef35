"""Per-edge shared-memory slots: large arrays cross ipc without going through a kernel socket.

A ``Sender`` on ipc owns one block of ``slots`` × ``slot_bytes`` (POSIX shared memory). A message
whose arrays fit a slot is copied into the next free slot and only a small reference frame travels:
``<u32 slot><u64 length per array>``. Its receiver opens the block when the sender says HELLO
(geometry frame: msgpack ``{"name", "slots", "slot_bytes"}``), validates every reference like any
header field and copies the arrays out at once (``pread``: the receiver never maps a peer's block, so
a block truncated under it is a bad message, not SIGBUS), so a slot is free again before its credit
returns.

Lifetime: the sender unlinks its block on close or at interpreter exit, and its block stays
registered with Python's resource tracker, a separate process that unlinks it even when every
process of the session was killed. The receiver opens blocks without the tracker (on 3.11
``SharedMemory(name)`` registers attached blocks too, and unregistering them would also drop the
sender's registration when both ends share a process); it unlinks the block of a sender it declares
dead (kill -9 of a sender leaves nothing in /dev/shm) and those it still holds when it closes.
"""

from __future__ import annotations

import _posixshmem
import os
import re
import secrets
import struct
import weakref
from collections.abc import Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import msgpack

MAX_SLOTS = 4096
NAME_PREFIX = "charstream-"
# Only names we generate: a hostile peer must not make the receiver attach (and later unlink) another
# program's block.
_NAME = re.compile(rf"{NAME_PREFIX}[0-9a-f]{{16}}")
_SLOT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")


class SlotError(ValueError):
    """A bad geometry, slot reference or block (the channel turns it into a counted bad message)."""


def _release_owned(shm: SharedMemory) -> None:
    shm.close()
    try:
        shm.unlink()  # also ends the resource tracker's watch
    except FileNotFoundError:  # the receiver was first (it closed, or thought us dead)
        resource_tracker.unregister(shm._name, "shared_memory")


class SlotBlock:
    """The sender's block: ``slots`` slots of ``slot_bytes``, written in turn."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.shm = SharedMemory(f"{NAME_PREFIX}{secrets.token_hex(8)}", create=True, size=slots * slot_bytes)
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._reserved = [False] * slots
        # The block goes with the sender on any exit path that runs Python (GC, atexit).
        self._finalizer = weakref.finalize(self, _release_owned, self.shm)

    def geometry(self) -> bytes:
        """The HELLO payload that lets the receiver attach."""
        return msgpack.packb({"name": self.shm.name, "slots": self.slots, "slot_bytes": self.slot_bytes})

    def write(self, slot: int, buffers: Sequence[memoryview]) -> bytes | None:
        """Copy ``buffers`` into ``slot``; the reference frame, or None if tmpfs has no room for it."""
        if not self._reserved[slot]:
            try:
                # Touching a page that tmpfs cannot back is SIGBUS, not an exception: reserve first.
                os.posix_fallocate(self.shm._fd, slot * self.slot_bytes, self.slot_bytes)
            except OSError:
                return None
            self._reserved[slot] = True
        offset = slot * self.slot_bytes
        for b in buffers:
            self.shm.buf[offset:offset + b.nbytes] = b
            offset += b.nbytes
        return _SLOT.pack(slot) + b"".join(_LENGTH.pack(b.nbytes) for b in buffers)

    def close(self) -> None:
        """Unmap and unlink (idempotent); a receiver that opened the block keeps its own descriptor."""
        self._finalizer()


class SlotView:
    """The receiver's descriptor of a sender's block, from its HELLO geometry (never mapped)."""

    def __init__(self, geometry: bytes, max_slot_bytes: int) -> None:
        """Every geometry field is validated before anything is mapped; raises SlotError."""
        try:
            g = msgpack.unpackb(geometry, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for garbage
            raise SlotError(f"slot geometry is not msgpack ({type(e).__name__})") from None
        if not isinstance(g, dict) or set(g) != {"name", "slots", "slot_bytes"}:
            raise SlotError("slot geometry is not a map with keys name, slots, slot_bytes")
        name, slots, slot_bytes = g["name"], g["slots"], g["slot_bytes"]
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise SlotError(f"bad shared-memory name {name!r}")
        for what, value, most in (("slots", slots, MAX_SLOTS), ("slot_bytes", slot_bytes, max_slot_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise SlotError(f"bad {what} {value!r} (1..{most})")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
        except OSError as e:
            raise SlotError(f"cannot attach shared memory {name!r}: {e}") from None
        size = os.fstat(fd).st_size
        if size < slots * slot_bytes:
            os.close(fd)
            raise SlotError(f"shared memory {name!r} holds {size} bytes, geometry says {slots} x {slot_bytes}")
        self.name = name
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._fd = fd

    def read(self, ref: bytes) -> list[bytes]:
        """The arrays a reference frame points at, copied out of the slot (validated first)."""
        if len(ref) < _SLOT.size or (len(ref) - _SLOT.size) % _LENGTH.size:
            raise SlotError(f"slot reference of {len(ref)} bytes")
        (slot,) = _SLOT.unpack_from(ref)
        lengths = [n for (n,) in _LENGTH.iter_unpack(ref[_SLOT.size:])]
        if slot >= self.slots or sum(lengths) > self.slot_bytes:
            raise SlotError(f"slot {slot}, {sum(lengths)} bytes: outside {self.slots} slots of {self.slot_bytes} bytes")
        offset = slot * self.slot_bytes
        arrays = []
        for n in lengths:
            # pread, not a mapping: a sender that truncated its block gives a short read here, where a
            # mapped page past the end of the file would kill this process with SIGBUS.
            data = os.pread(self._fd, n, offset)
            if len(data) != n:
                raise SlotError(f"shared memory {self.name!r} was truncated under slot {slot}")
            arrays.append(data)
            offset += n
        return arrays

    def close(self, unlink: bool) -> None:
        """Close; ``unlink`` also removes the name (for a sender that cannot do it any more)."""
        os.close(self._fd)
        if unlink:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:  # the sender (or its resource tracker) was first
                pass
