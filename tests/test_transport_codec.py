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
    Conditioning,
    Control,
    ControlKind,
    Latents,
    TraceContext,
    TurnEvent,
    TurnKind,
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
        Control("s", 6, ControlKind.ROLLBACK, chunk=41, epoch=3, detail={"stage": "playout", "n": 2, "ok": True, "x": None}),
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


# --- property-based fuzz: decode returns a valid message or raises MessageError, nothing else ---

# Hypothesis draws one blob (seed, bytes) so 10,000 examples stay fast; the seed then builds frames
# from pools of plausible and hostile values (bench_fuzz.codec_frames), reaching deep validator paths.
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
