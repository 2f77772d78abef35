"""Per-edge shared-memory slots: large arrays cross ipc without going through a kernel socket.

A ``Sender`` on ipc owns one block of ``slots`` × ``slot_bytes``: a ``memfd`` sealed against
shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``, as Wayland and PipeWire seal
the shared memory of an untrusted client). A message whose arrays fit a slot is copied into the next
free slot and only a small reference frame travels: ``<u32 slot><u64 length per array>``. Its
receiver maps the block when the sender says HELLO (geometry frame: msgpack ``{"fd", "slots",
"slot_bytes"}``), validates every reference like any header field and copies the arrays out of the
mapping at once, so a slot is free again before its credit returns (credits come back when the
consumer *takes* a message, and the consumer may keep its arrays for as long as it likes: one copy,
into memory the consumer owns and may write, is the least that lets the sender reuse the slot).
That memory comes from a bounded pool of receive buffers (``ReceiveBuffers``): a buffer whose arrays
every consumer has dropped is copied into again, its pages already faulted in, whatever the allocator
did with freed memory meanwhile (a fresh 9.2 MB array after ``malloc_trim``, or with glibc's thresholds
fixed, faults in 2,250 pages). Zero-copy views of the mapping are not offered: the sender writes that
memory, so the consumer could not own what it reads, and a held view would hold the slot past its credit.

Why seals: a mapping of a file that its owner truncates gives SIGBUS on the next read past the new
end, which kills the receiver. With SHRINK sealed, the kernel refuses ``ftruncate`` (EPERM) to the
sender and to anyone else, and seals can neither be removed nor (SEAL sealed) changed, so a block
whose seals and size the receiver checked before mapping stays mappable for as long as it is mapped.

How the receiver gets the descriptor: it opens ``/proc/<pid>/fd/<fd>``, where ``fd`` is the
number in HELLO and ``pid`` is *not* taken from the message but from the ZeroMQ connection itself:
on ipc, libzmq reads the peer's ``SO_PEERCRED`` when it accepts the connection and reports it in
every message's ``Peer-Address`` property (``...:uid:gid:pid``). So a peer can only point the
receiver at one of its own descriptors, the HELLO stays one ZeroMQ message (no second socket to
bind, find, clean up and match to the ZeroMQ peer, as ``SCM_RIGHTS`` would need: ZeroMQ passes no
ancillary data), and it works between unrelated processes of one user (an engine and its
front-ends), where ``pidfd_getfd`` needs ptrace-attach rights that Yama (``ptrace_scope`` 1) gives
only to ancestors. Peers in different users or PID namespaces cannot open each other's descriptors:
use tcp there, or ``slot_bytes = 0``.

Lifetime: a memfd has no name, so nothing is ever left in /dev/shm. Its memory goes when the last
descriptor and mapping of it go: the sender's on close or at exit (the kernel closes them even
after kill -9), the receiver's when the sender says BYE, when the receiver declares it dead, or when
the receiver closes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import sys
import weakref
from collections.abc import Sequence

import msgpack
import numpy as np

MAX_SLOTS = 4096
MAX_ARRAYS = 64  # per slot reference; a message type has a few array fields, and each costs a buffer's padding
MEMFD_NAME = "charstream-slots"  # shows as /memfd:charstream-slots in /proc/<pid>/maps
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MAX_FD = 2**31 - 1
_SLOT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")
_ALIGN = 64  # each array of a message starts on a cache line in its receive buffer, as a fresh array would


class SlotError(ValueError):
    """A bad geometry, slot reference or block (the channel turns it into a counted bad message)."""


def _release_owned(buf: mmap.mmap, fd: int) -> None:
    buf.close()
    os.close(fd)


class SlotBlock:
    """The sender's block: ``slots`` slots of ``slot_bytes`` in a sealed memfd, written in turn."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, slots * slot_bytes)  # sparse: a slot's pages are reserved as messages need them
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            self.buf = mmap.mmap(fd, slots * slot_bytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._reserved = [0] * slots  # bytes reserved at each slot's start: its largest message so far
        # The block goes with the sender on any exit path that runs Python (GC, atexit); the kernel
        # closes the rest.
        self._finalizer = weakref.finalize(self, _release_owned, self.buf, fd)

    def geometry(self) -> bytes:
        """The HELLO payload that lets the receiver map the block."""
        return msgpack.packb({"fd": self.fd, "slots": self.slots, "slot_bytes": self.slot_bytes})

    def write(self, slot: int, buffers: Sequence[memoryview]) -> bytes | None:
        """Copy ``buffers`` into ``slot``; the reference frame, or None if memory for it ran out."""
        size = sum(b.nbytes for b in buffers)
        if size > self._reserved[slot]:
            try:
                # A page that shmem cannot back is SIGBUS or the OOM killer on first touch, not an
                # exception: reserve what the message needs first (ENOMEM here means inline sending).
                # Only that much: a slot sized for the largest message costs small ones nothing.
                os.posix_fallocate(self.fd, slot * self.slot_bytes, size)
            except OSError:
                return None
            self._reserved[slot] = size
        offset = slot * self.slot_bytes
        for b in buffers:
            self.buf[offset:offset + b.nbytes] = b
            offset += b.nbytes
        return _SLOT.pack(slot) + b"".join(_LENGTH.pack(b.nbytes) for b in buffers)

    def close(self) -> None:
        """Unmap and close (idempotent); a receiver that mapped the block keeps its own mapping."""
        self._finalizer()


def mapped_blocks(pid: int | str = "self") -> int:
    """Slot blocks mapped in a process (a memfd has no name in /dev/shm to count): for leak checks."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(f"/memfd:{MEMFD_NAME}" in line for line in f)


def peer_pid(peer_address: str | None) -> int | None:
    """The pid in a ZeroMQ ipc ``Peer-Address`` property (``host:uid:gid:pid``), else None."""
    fields = (peer_address or "").rsplit(":", 3)
    return int(fields[3]) if len(fields) == 4 and fields[3].isdecimal() else None


def _open_block(pid: int, fd: int) -> int:
    """A read-only descriptor of the peer's ``fd``, if it is a regular file (never a FIFO or a
    device: the peer chooses the number, and opening those can block or have side effects)."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise SlotError(f"fd {fd} of process {pid} is not a memfd")
        own = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        raise SlotError(f"cannot open fd {fd} of process {pid}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(own).st_mode):  # the peer swapped the descriptor in between
        os.close(own)
        raise SlotError(f"fd {fd} of process {pid} is not a memfd")
    return own


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class ReceiveBuffers:
    """At most ``most`` receive buffers, each reused once nothing but this pool refers to it.

    A message's arrays are views of one buffer (numpy keeps the buffer alive through every view, and
    through anything built on one: a reshape, ``np.frombuffer``, ``torch.from_numpy``), so a buffer
    that only the pool refers to is one no consumer can reach: writing it again cannot change an
    array anyone holds. While every pooled buffer is held, a message gets a fresh, unpooled buffer:
    nothing waits, and the pool never grows past ``most``.
    """

    def __init__(self, most: int) -> None:
        self.most = most
        self._buffers: list[np.ndarray] = []
        self.reused = 0  # messages copied into a buffer that was already faulted in
        self.fresh = 0  # messages that needed new memory (pool filling, sizes changing or all held)
        probe = [np.empty(0, np.uint8)]
        self._free_refs = sys.getrefcount(probe[0])  # a buffer referred to by its list alone

    def take(self, nbytes: int) -> np.ndarray:
        """A writable buffer of ``nbytes`` that no consumer refers to."""
        spare = None
        for i in range(len(self._buffers)):
            if sys.getrefcount(self._buffers[i]) == self._free_refs:
                if self._buffers[i].nbytes == nbytes:
                    self.reused += 1
                    return self._buffers[i]
                spare = i if spare is None else spare
        self.fresh += 1
        buf = np.empty(nbytes, np.uint8)
        if len(self._buffers) < self.most:
            self._buffers.append(buf)
        elif spare is not None:  # a free buffer of another size gives its place to the size now in use
            self._buffers[spare] = buf
        return buf

    def __len__(self) -> int:
        return len(self._buffers)


class SlotView:
    """The receiver's read-only mapping of a sender's block, from its HELLO geometry."""

    def __init__(self, geometry: bytes, max_slot_bytes: int, pid: int | None, buffers: int = 2) -> None:
        """Every geometry field, the block's seals and its size are checked before anything is
        mapped; ``pid`` is the sender's, from its connection; ``buffers``: receive buffers kept for
        reuse. Raises SlotError."""
        try:
            g = msgpack.unpackb(geometry, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated types for garbage
            raise SlotError(f"slot geometry is not msgpack ({type(e).__name__})") from None
        if not isinstance(g, dict) or set(g) != {"fd", "slots", "slot_bytes"}:
            raise SlotError("slot geometry is not a map with keys fd, slots, slot_bytes")
        fd, slots, slot_bytes = g["fd"], g["slots"], g["slot_bytes"]
        for what, value, least, most in (
            ("fd", fd, 0, _MAX_FD), ("slots", slots, 1, MAX_SLOTS), ("slot_bytes", slot_bytes, 1, max_slot_bytes)
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
                raise SlotError(f"bad {what} {value!r} ({least}..{most})")
        if pid is None:
            raise SlotError("the sender's process is unknown (slots need an ipc connection)")
        own = _open_block(pid, fd)
        try:
            try:
                seals = fcntl.fcntl(own, fcntl.F_GET_SEALS)
            except OSError:
                raise SlotError(f"fd {fd} of process {pid} is not a memfd (it cannot be sealed)") from None
            if seals & SEALS != SEALS:
                raise SlotError(f"block (fd {fd} of process {pid}) is not sealed against shrink, grow and "
                                f"reseal (seals {seals:#x}): it could be truncated under the mapping")
            size = os.fstat(own).st_size
            if size != slots * slot_bytes:
                raise SlotError(f"block (fd {fd} of process {pid}) holds {size} bytes, geometry says "
                                f"{slots} x {slot_bytes}")
            mapping = mmap.mmap(own, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(own)  # the mapping keeps the memory
        self.pid = pid
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._mmap = mapping
        self._bytes = np.frombuffer(mapping, np.uint8)
        self.buffers = ReceiveBuffers(buffers)

    def read(self, ref: bytes) -> list[np.ndarray]:
        """The arrays a reference frame points at, copied out of the slot (validated first)."""
        if len(ref) < _SLOT.size or (len(ref) - _SLOT.size) % _LENGTH.size \
                or len(ref) > _SLOT.size + MAX_ARRAYS * _LENGTH.size:
            raise SlotError(f"slot reference of {len(ref)} bytes")
        (slot,) = _SLOT.unpack_from(ref)
        lengths = [n for (n,) in _LENGTH.iter_unpack(ref[_SLOT.size:])]
        if slot >= self.slots or sum(lengths) > self.slot_bytes:
            raise SlotError(f"slot {slot}, {sum(lengths)} bytes: outside {self.slots} slots of {self.slot_bytes} bytes")
        offset = slot * self.slot_bytes
        buf = self.buffers.take(sum(_aligned(n) for n in lengths))  # the consumer's own, writable memory
        arrays, at = [], 0
        for n in lengths:
            array = buf[at:at + n]
            np.copyto(array, self._bytes[offset:offset + n])
            arrays.append(array)
            offset += n
            at += _aligned(n)
        return arrays

    def close(self) -> None:
        """Unmap (the memory goes once the sender's descriptor has gone too)."""
        del self._bytes  # an exported buffer would keep the mapping from closing
        self._mmap.close()
