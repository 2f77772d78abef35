"""Wire codec for the message dataclasses: a msgpack header frame plus one raw frame per array.

Frame 0 is msgpack ``{"v": WIRE_VERSION, "t": type name, "f": {scalar fields}, "a": [[field,
dtype, shape], ...]}``; frames 1.. are the arrays' bytes, in the order of ``"a"``. No pickle: the
header holds plain values only, and arrays are rebuilt with ``np.frombuffer`` over the received
buffer (zero-copy; the resulting arrays are read-only, copy one before writing into it).

``decode`` trusts nothing: every problem (not msgpack, wrong version, unknown type, a field of the
wrong type, an int outside int64 or a float that is not finite, a missing or extra frame, an array
whose dtype/shape disagrees with its frame or declares more than the limit, a message over the size
limit) raises ``MessageError`` naming the channel, the peer and the problem. A control's payload
travels as ``[payload type, {fields}]`` and is checked the same way, then against its kind and its
own ranges (the payload dataclasses' checks).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from charstream.transport.messages import (
    CONTROL_PAYLOADS,
    MESSAGE_TYPES,
    Control,
    ControlPayload,
    Message,
    TraceContext,
)

WIRE_VERSION = 1
MAX_NDIM = 8
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # int fields end up in numpy int64 and torch: nothing wider travels
_TYPES: dict[str, type] = {cls.__name__: cls for cls in MESSAGE_TYPES}
_PAYLOADS: dict[str, type] = {cls.__name__: cls for cls in CONTROL_PAYLOADS.values()}
_PAYLOAD_HINT = ControlPayload | None
# Plain numeric dtypes in either byte order; object/void/string dtypes never travel.
_DTYPES: frozenset[str] = frozenset(
    np.dtype(code).newbyteorder(order).str for code in "?bBhHiIqQefd" for order in "<>"
)


class MessageError(ValueError):
    """A message that cannot be encoded or decoded; names the channel, the peer and the problem."""

    def __init__(self, problem: str, channel: str = "?", peer: str = "?") -> None:
        super().__init__(f"channel {channel!r}, peer {peer!r}: {problem}")
        self.problem = problem
        self.channel = channel
        self.peer = peer

    def __reduce__(self):  # pickled by its fields, not by its message (which would be wrapped again)
        return type(self), (self.problem, self.channel, self.peer)


class _Mismatch(Exception):
    """A header value of the wrong type (internal; becomes a MessageError)."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_HINTS: dict[type, dict[str, Any]] = {cls: _hints(cls) for cls in (*MESSAGE_TYPES, TraceContext, *_PAYLOADS.values())}
_ARRAY_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(name for name, hint in _HINTS[cls].items() if hint is np.ndarray) for cls in MESSAGE_TYPES
}


def encode(msg: Message, max_bytes: int | None = None) -> list[bytes | memoryview]:
    """Frames for ``msg``: the header, then each array's buffer (not copied if already contiguous)."""
    cls = type(msg)
    if cls not in _ARRAY_FIELDS:
        raise MessageError(f"cannot encode {cls.__name__}: not a message type")
    fields: dict[str, Any] = {}
    arrays: list[list[Any]] = []
    buffers: list[memoryview] = []
    for name in (f.name for f in dataclasses.fields(msg)):
        value = getattr(msg, name)
        if name in _ARRAY_FIELDS[cls]:
            array = np.ascontiguousarray(value)
            if array.dtype.str not in _DTYPES:
                raise MessageError(f"{cls.__name__}.{name}: dtype {array.dtype} cannot travel")
            arrays.append([name, array.dtype.str, list(array.shape)])
            buffers.append(memoryview(array.reshape(-1).view(np.uint8)))
        else:
            fields[name] = _plain(value)
    if cls is Control:  # a payload built with values of the wrong type is refused here, not by the peer
        try:
            _payload(fields["payload"], "payload")
        except _Mismatch as e:
            raise MessageError(f"Control({msg.kind}): {e}") from None
    header = msgpack.packb({"v": WIRE_VERSION, "t": cls.__name__, "f": fields, "a": arrays})
    size = len(header) + sum(b.nbytes for b in buffers)
    if max_bytes is not None and size > max_bytes:
        raise MessageError(f"{cls.__name__} of {size} bytes exceeds the limit of {max_bytes} bytes")
    return [header, *buffers]


def _plain(value: Any) -> Any:
    if isinstance(value, TraceContext):
        return {"turn_id": value.turn_id, "stamps": dict(value.stamps)}
    if isinstance(value, enum.Enum):
        return value.value
    if type(value) in _PAYLOADS.values():
        return [type(value).__name__, {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}]
    return value


def decode(frames: Sequence[Any], max_bytes: int, channel: str = "?", peer: str = "?") -> Message:
    """Rebuild a message from ``frames`` (bytes, memoryviews or zmq Frames), validating everything."""
    views = [memoryview(getattr(f, "buffer", f)) for f in frames]
    try:
        return _decode(views, max_bytes)
    except MessageError as e:
        raise MessageError(e.problem, channel, peer) from None


def _decode(views: list[memoryview], max_bytes: int) -> Message:
    if not views:
        raise MessageError("empty message (no header frame)")
    size = sum(v.nbytes for v in views)
    if size > max_bytes:
        raise MessageError(f"message of {size} bytes exceeds the limit of {max_bytes} bytes")
    try:
        header = msgpack.unpackb(views[0], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise MessageError(f"header is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict) or set(header) != {"v", "t", "f", "a"}:
        raise MessageError("header is not a map with keys v, t, f, a")
    if type(header["v"]) is not int or header["v"] != WIRE_VERSION:  # True and 1.0 equal 1
        raise MessageError(f"wire version {header['v']!r}, expected {WIRE_VERSION}")
    cls = _TYPES.get(header["t"]) if isinstance(header["t"], str) else None
    if cls is None:
        raise MessageError(f"unknown message type {header['t']!r}")
    specs, fields = header["a"], header["f"]
    if not isinstance(specs, list) or not isinstance(fields, dict):
        raise MessageError(f"{cls.__name__}: 'a' must be a list and 'f' a map")
    if len(specs) != len(views) - 1:
        raise MessageError(f"{cls.__name__}: header lists {len(specs)} arrays but {len(views) - 1} frames follow")
    arrays = {}
    for spec, view in zip(specs, views[1:], strict=True):
        name, array = _array(cls, spec, view, max_bytes)
        if name in arrays:
            raise MessageError(f"{cls.__name__}.{name}: array sent twice")
        arrays[name] = array
    missing = set(_ARRAY_FIELDS[cls]) - set(arrays)
    if missing:
        raise MessageError(f"{cls.__name__}: missing array(s) {sorted(missing)}")
    try:
        values = _fields(cls, fields, set(_ARRAY_FIELDS[cls]))
        return cls(**values, **arrays)
    except (_Mismatch, ValueError) as e:  # ValueError: a control whose payload is not its kind's
        raise MessageError(f"{cls.__name__}: {e}") from None


def _array(cls: type, spec: Any, view: memoryview, max_bytes: int) -> tuple[str, np.ndarray]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str)):
        raise MessageError(f"{cls.__name__}: array spec {spec!r} is not [field, dtype, shape]")
    name, dtype, shape = spec
    if name not in _ARRAY_FIELDS[cls]:
        raise MessageError(f"{cls.__name__}: {name!r} is not an array field")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise MessageError(f"{cls.__name__}.{name}: dtype {dtype!r} not allowed")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_NDIM
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise MessageError(f"{cls.__name__}.{name}: bad shape {shape!r}")
    # An empty array may still declare a dimension numpy cannot hold ([0, 2**63]): the non-zero
    # dimensions alone must fit the message limit.
    if math.prod(d for d in shape if d) * np.dtype(dtype).itemsize > max_bytes:
        raise MessageError(f"{cls.__name__}.{name}: shape {shape!r} exceeds the limit of {max_bytes} bytes")
    expected = math.prod(shape) * np.dtype(dtype).itemsize
    if expected != view.nbytes:
        raise MessageError(
            f"{cls.__name__}.{name}: header says {dtype} {shape} = {expected} bytes, frame has {view.nbytes}"
        )
    return name, np.frombuffer(view, dtype=dtype).reshape(shape)


def _fields(cls: type, data: dict[str, Any], skip: set[str], prefix: str = "") -> dict[str, Any]:
    hints = _HINTS[cls]
    unknown = set(data) - (set(hints) - skip)
    if unknown:
        raise _Mismatch(f"unknown field(s) {sorted(prefix + str(k) for k in unknown)}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in data:
            values[f.name] = _convert(data[f.name], hints[f.name], prefix + f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _Mismatch(f"missing field {prefix + f.name!r}")
    return values


def _convert(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked against the type hint ``hint``; raises _Mismatch naming ``path``."""
    if hint == _PAYLOAD_HINT:
        return _payload(value, path)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _convert(value, option, path)
            except _Mismatch:
                continue
        raise _Mismatch(f"{path}: {type(value).__name__} is not {hint}")
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        if not isinstance(value, dict):
            raise _Mismatch(f"{path}: expected a map, got {type(value).__name__}")
        return {_convert(k, key_hint, path): _convert(v, value_hint, f"{path}[{k!r}]") for k, v in value.items()}
    if hint is TraceContext:
        if not isinstance(value, dict):
            raise _Mismatch(f"{path}: expected a map, got {type(value).__name__}")
        return TraceContext(**_fields(TraceContext, value, set(), f"{path}."))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except (ValueError, TypeError):
            raise _Mismatch(f"{path}: {value!r} is not a {hint.__name__}") from None
    ok = {
        type(None): value is None,
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool) and INT_MIN <= value <= INT_MAX,
        float: isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value),
        str: isinstance(value, str),
    }.get(hint)
    if ok is None:
        raise _Mismatch(f"{path}: unsupported field type {hint}")
    if not ok:
        got = f"{type(value).__name__} {value!r}"[:60] if type(value) in (int, float) else type(value).__name__
        raise _Mismatch(f"{path}: expected {getattr(hint, '__name__', hint)}, got {got}")
    return float(value) if hint is float else value


def _payload(value: Any, path: str) -> ControlPayload | None:
    """A control's payload from ``[payload type, {fields}]`` (or None), its fields and ranges checked."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict)):
        raise _Mismatch(f"{path}: expected [payload type, {{fields}}], got {type(value).__name__}")
    cls = _PAYLOADS.get(value[0]) if isinstance(value[0], str) else None
    if cls is None:
        raise _Mismatch(f"{path}: unknown payload type {value[0]!r}")
    values = _fields(cls, value[1], set(), f"{path}.")
    try:
        return cls(**values)
    except ValueError as e:
        raise _Mismatch(f"{path}: {cls.__name__}: {e}") from None
