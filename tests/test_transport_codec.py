"""The wire codec: round trips, each kind of bad input, and a property-based fuzz of ``decode``."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charstream.pipeline.bench.fuzz import codec_frames, well_typed
from charstream.transport.codec import WIRE_VERSION, MessageError, decode, encode
from charstream.transport.messages import (
    AgentAudio,
    ClockPayload,
    Conditioning,
    Control,
    ControlKind,
    ErrorPayload,
    InterruptPayload,
    Latents,
    RollbackPayload,
    ShutdownPayload,
    TraceContext,
    TurnEvent,
    TurnKind,
    TurnStartPayload,
    VideoChunk,
)

LIMIT = 1 << 20


def examples():
    trace = TraceContext(7, {"user_speech_end": 1.5, "agent_first_audio": 2.25})
    audio = np.arange(8000, dtype=np.int16)
    return [
        AgentAudio("s", 1, audio, start_sample=16000, trace=trace),
        TurnEvent("s", 2, TurnKind.USER_SPEECH_END, turn_id=7, at=12.5),
        Conditioning("s", 3, np.random.rand(9, 32).astype(np.float32), audio, True, epoch=2, trace=trace),
        Latents("s", 4, np.random.rand(16, 8, 8).astype(np.float16), audio, False),
        VideoChunk("s", 5, np.random.randint(0, 255, (4, 16, 16, 3), np.uint8), audio, True),
        Control("s", 6, ControlKind.ROLLBACK, chunk=41, epoch=3,
                payload=RollbackPayload(ControlKind.TURN_START, onset_frame=2, dropped=3, kept=1, placed_at=1.5, due_at=2.0)),
        VideoChunk("s", 5, np.random.randint(0, 255, (3, 16, 16, 3), np.uint8), audio[:0], True, offset=1),  # a part
    ]


def assert_same(a, b):
    assert type(a) is type(b)
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype and other.shape == value.shape
            np.testing.assert_array_equal(other, value)
        else:
            assert other == value, name


@pytest.mark.parametrize("msg", examples(), ids=lambda m: type(m).__name__)
def test_round_trip_every_message_type(msg):
    frames = encode(msg)
    assert len(frames) == 1 + sum(isinstance(v, np.ndarray) for v in vars(msg).values())
    assert_same(decode(frames, LIMIT), msg)


def test_arrays_are_zero_copy_views_of_the_received_buffer():
    msg = examples()[4]
    frames = [bytes(f) for f in encode(msg)]  # as received: immutable buffers
    out = decode(frames, LIMIT)
    assert not out.frames.flags.writeable  # a view over the frame, not a copy
    assert np.shares_memory(out.frames, np.frombuffer(frames[1], np.uint8))


def test_non_contiguous_and_big_endian_arrays_survive():
    tokens = np.arange(24, dtype=">f4").reshape(4, 6)[:, ::2]
    msg = Conditioning("s", 0, tokens, np.zeros(0, np.int16), False)
    assert_same(decode(encode(msg), LIMIT), msg)


def _header(frames):
    return msgpack.unpackb(frames[0])


def _with_header(frames, **changes):
    header = _header(frames)
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


def bad_inputs():
    msg = examples()[2]  # Conditioning: two arrays
    good = [bytes(f) for f in encode(msg)]
    spec = _header(good)["a"]
    wrong_shape = [list(s) for s in spec]
    wrong_shape[0][2] = [9, 33]
    event = [bytes(f) for f in encode(examples()[1])]  # TurnEvent: a float field
    impossible = [list(s) for s in spec]
    impossible[0][2] = [0, 2**63]  # 0 bytes, so the size check passes; numpy cannot reshape to it
    return {
        "empty array with an impossible dimension": (
            [_with_header(good, a=impossible)[0], b"", good[2]], "exceeds the limit"),
        "empty array with dimensions over the limit": (
            [_with_header(good, a=[["audio_tokens", "<f4", [0, 2**40, 2**40]], spec[1]])[0], b"", good[2]],
            "exceeds the limit"),
        "version true": (_with_header(good, v=True), "wire version True"),
        "version 1.0": (_with_header(good, v=1.0), "wire version 1.0"),
        "int beyond int64": (_with_header(good, f={**_header(good)["f"], "chunk": 2**64 - 1}), "chunk: expected int"),
        "nan float": (_with_header(event, f={**_header(event)["f"], "at": float("nan")}), "at: expected float, got float nan"),
        "random bytes": ([np.random.default_rng(0).bytes(100)], "not msgpack"),
        "empty": ([], "empty message"),
        "truncated multipart": (good[:2], "header lists 2 arrays but 1 frames follow"),
        "extra frame": ([*good, b"x"], "header lists 2 arrays but 3 frames follow"),
        "wrong version": (_with_header(good, v=WIRE_VERSION + 1), "wire version"),
        "unknown type": (_with_header(good, t="Pickle"), "unknown message type 'Pickle'"),
        "size mismatch": (_with_header(good, a=wrong_shape), "frame has"),
        "object dtype": (_with_header(good, a=[["audio_tokens", "|O", [9, 32]], spec[1]]), "not allowed"),
        "not an array field": (_with_header(good, a=[["chunk", "<f4", [9, 32]], spec[1]]), "not an array field"),
        "field of wrong type": (_with_header(good, f={**_header(good)["f"], "chunk": "three"}), "chunk: expected int"),
        "bool is not int": (_with_header(good, f={**_header(good)["f"], "chunk": True}), "chunk: expected int"),
        "unknown field": (_with_header(good, f={**_header(good)["f"], "evil": 1}), "unknown field"),
        "missing field": (_with_header(good, f={"session_id": "s"}), "missing field"),
        "bad trace": (_with_header(good, f={**_header(good)["f"], "trace": {"stamps": {"a": "b"}}}), "trace.stamps['a']"),
        "over the size limit": (good, "exceeds the limit"),
    }


@pytest.mark.parametrize("case", list(bad_inputs()))
def test_bad_input_is_a_clear_message_error(case):
    frames, expected = bad_inputs()[case]
    limit = 1000 if case == "over the size limit" else LIMIT
    with pytest.raises(MessageError) as info:
        decode(frames, limit, channel="cond->diff", peer="cond")
    text = str(info.value)
    assert expected in text
    assert "'cond->diff'" in text and "'cond'" in text
    assert info.value.channel == "cond->diff" and info.value.peer == "cond"


def test_encode_refuses_oversize_and_unsendable_arrays():
    with pytest.raises(MessageError, match="exceeds the limit"):
        encode(examples()[4], max_bytes=1000)
    with pytest.raises(MessageError, match="cannot travel"):
        encode(Conditioning("s", 0, np.array([object()]), np.zeros(1, np.int16), False))


# --- control payloads: one typed payload per kind, checked like the rest of the message ---

def controls():
    """A valid control of each kind that carries data, and of each without (None)."""
    return {
        ControlKind.TURN_START: TurnStartPayload(earliest_chunk=7, last_emit_at=1.5, encode_s=0.012),
        ControlKind.ROLLBACK: RollbackPayload(ControlKind.INTERRUPT, onset_frame=0, dropped=4, kept=0),
        ControlKind.CLOCK: ClockPayload(due_at=1.25),
        ControlKind.INTERRUPT: InterruptPayload(at_sample=96_000),
        ControlKind.ERROR: ErrorPayload("diffusion", "RuntimeError: boom"),
        ControlKind.SHUTDOWN: ShutdownPayload("shutdown by egress"),
    }


@pytest.mark.parametrize("kind", list(ControlKind))
@pytest.mark.parametrize("bare", [False, True], ids=["payload", "bare"])
def test_every_control_kind_round_trips(kind, bare):
    msg = Control("s", 3, kind, chunk=5, epoch=2, payload=None if bare else controls()[kind], trace=TraceContext(4))
    assert_same(decode(encode(msg), LIMIT), msg)


def _control_with(kind, fields):
    """A valid control of ``kind`` whose payload's fields are replaced by ``fields`` on the wire."""
    frames = [bytes(f) for f in encode(Control("s", 3, kind, chunk=5, payload=controls()[kind]))]
    header = _header(frames)
    name, good = header["f"]["payload"]
    return _with_header(frames, f={**header["f"], "payload": [name, {**good, **fields}]})


MALFORMED = {  # kind -> (fields sent, what the error says)
    ControlKind.TURN_START: ({"encode_s": -0.5}, "encode_s must be >= 0"),
    ControlKind.ROLLBACK: ({"onset_frame": -1}, "onset_frame must be >= 0"),
    ControlKind.CLOCK: ({"due_at": "soon"}, "payload.due_at: expected float"),
    ControlKind.INTERRUPT: ({"at_sample": -1}, "at_sample must be >= 0"),
    ControlKind.ERROR: ({"stage": ""}, "stage must not be empty"),
    ControlKind.SHUTDOWN: ({"reason": None}, "payload.reason: expected str"),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_payload_of_each_kind_is_refused_clearly(kind):
    fields, expected = MALFORMED[kind]
    with pytest.raises(MessageError) as info:
        decode(_control_with(kind, fields), LIMIT, channel="control", peer="playout")
    assert expected in str(info.value) and "'playout'" in str(info.value), str(info.value)


@pytest.mark.parametrize("case,change,expected", [
    ("missing field", {"payload": ["RollbackPayload", {"reason": "interrupt", "onset_frame": 0}]}, "missing field 'payload.dropped'"),
    ("unknown field", {"payload": ["ClockPayload", {"due_at": 1.0, "evil": 1}]}, "unknown field(s) ['payload.evil']"),
    ("another kind's payload", {"payload": ["ClockPayload", {"due_at": 1.0}]}, "a rollback control carries a RollbackPayload"),
    ("unknown payload type", {"payload": ["Pickle", {}]}, "unknown payload type 'Pickle'"),
    ("not [type, fields]", {"payload": {"onset_frame": 1}}, "expected [payload type, {fields}]"),
    ("reason not a kind", {"payload": ["RollbackPayload", {"reason": "nap", "onset_frame": 0, "dropped": 0, "kept": 0}]},
     "'nap' is not a ControlKind"),
    ("reason not a rollback's", {"payload": ["RollbackPayload", {"reason": "clock", "onset_frame": 0, "dropped": 0,
                                                                 "kept": 0}]}, "reason must be turn_start or interrupt"),
])
def test_a_control_payload_of_the_wrong_shape_is_refused(case, change, expected):
    frames = [bytes(f) for f in encode(examples()[5])]
    with pytest.raises(MessageError) as info:
        decode(_with_header(frames, f={**_header(frames)["f"], **change}), LIMIT, channel="control", peer="conditioning")
    assert expected in str(info.value) and "'conditioning'" in str(info.value), str(info.value)


def test_a_payload_that_cannot_travel_is_refused_by_the_sender():
    with pytest.raises(ValueError, match="carries a ClockPayload"):  # built for another kind
        Control("s", 1, ControlKind.CLOCK, payload=ShutdownPayload("x"))
    with pytest.raises(ValueError, match="onset_frame must be"):  # out of range
        RollbackPayload(ControlKind.TURN_START, onset_frame=-1, dropped=0, kept=0)
    with pytest.raises(MessageError, match="payload.onset_frame: expected int"):  # a numpy scalar is not an int on the wire
        encode(Control("s", 1, ControlKind.ROLLBACK, payload=RollbackPayload(ControlKind.TURN_START, np.int64(1), 0, 0)))


# --- property-based fuzz: decode returns a valid message or raises MessageError, nothing else ---

# Hypothesis draws one blob (seed, bytes) so 10,000 examples stay fast; the seed then builds frames
# from pools of plausible and hostile values (pipeline/bench/fuzz.py, codec_frames), reaching deep validator paths.
@settings(max_examples=10_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.binary(min_size=5, max_size=100))  # one draw: hypothesis's per-draw cost dominates otherwise
def test_fuzz_decoder_never_fails_unclearly(blob):
    frames = codec_frames(random.Random(blob[:4]), blob[4:])
    try:
        msg = decode(frames, LIMIT, channel="fuzz", peer="hypothesis")
    except MessageError as e:
        assert e.channel == "fuzz" and e.peer == "hypothesis" and e.problem
        return
    assert well_typed(msg), msg
