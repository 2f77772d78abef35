"""A short, seeded fuzz of every network-reading socket (the long run is ``charstream bench fuzz``).

Hypothesis draws each input's seed and bytes; ``pipeline.bench.fuzz`` turns them into frames or a
raw HTTP request for the real component, and a valid message must get through after every input.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charstream.pipeline.bench.fuzz import (
    HANG_S,
    METHODS,
    AgentTarget,
    ChannelTarget,
    ConfigTarget,
    HttpTarget,
    fuzz,
    hang_verdict,
)

EXAMPLES = 300
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", params=["ipc", "tcp"])
def channel(request):
    target = ChannelTarget(request.param)
    yield target
    stats = target.stats()
    target.close()
    assert stats["escapes"] == 0 and stats["wrongly_accepted"] == 0, stats
    assert stats["bad"] > EXAMPLES // 2 and stats["accepted"] > 0, stats  # the inputs reached both outcomes


@pytest.fixture(scope="module")
def http():
    target = HttpTarget()
    yield target
    target.close()


def _survives(target, blob: bytes) -> None:
    """``blob`` sent to ``target`` (its first 4 bytes seed how it is framed); a valid message still gets through."""
    target.send(random.Random(blob[:4]), blob[4:])
    assert target.probe(), target.stats()
    assert target.stats()["escapes"] == 0, target.stats()["escape_examples"]


def _fuzzed(target, inputs: int) -> dict:
    """The report of a seeded ``fuzz`` run of ``inputs`` inputs, a probe every 10; ``target`` closed after."""
    try:
        return fuzz(target, inputs, seed=18, probe_every=10)
    finally:
        target.close()


@FUZZ
@given(st.binary(min_size=4, max_size=300))
def test_channel_receiver_survives_any_frames(channel, blob):
    _survives(channel, blob)


@pytest.fixture(scope="module")
def agent():
    target = AgentTarget()
    yield target
    target.close()


@FUZZ
@given(st.binary(min_size=4, max_size=300))
def test_agent_socket_survives_any_message(agent, blob):
    _survives(agent, blob)  # the valid message: a whole turn


def test_agent_socket_accepts_only_finite_audio():
    report = _fuzzed(AgentTarget(), 1000)
    assert report["wrongly_accepted"] == 0, report["wrong_examples"]


@FUZZ
@given(st.binary(min_size=4, max_size=300))
def test_signaling_server_survives_any_request(http, blob):
    http.send(random.Random(blob[:4]), blob[4:])
    assert http.probe(), http.probe_failures
    counts = http.counts
    assert counts["escapes"] == counts["hangs"] == counts["wrongly_accepted"] == 0, http.stats()


def test_the_fuzz_run_reports_every_count(tmp_path):
    report = _fuzzed(HttpTarget(), 200)
    assert report["inputs"] == 200 and report["probes_sent"] == 22 and report["valid_lost"] == 0
    assert report["bad"] + report["accepted"] == 200 and report["escapes"] == report["hangs"] == 0


def test_hostile_configuration_is_refused_naming_a_key_or_serves():
    """Hostile numbers through ``PipelineConfig.from_dict`` and ``serve``'s command line: every refusal
    names a key it was given, nothing else escapes, and what is accepted for serving serves."""
    report = _fuzzed(ConfigTarget(sessions=2), 400)
    assert report["escapes"] == 0, report["escape_examples"]
    assert report["wrongly_accepted"] == 0, report["wrong_examples"]
    assert report["bad"] > 300 and report["accepted"] > 0 and report["via_cli"] > 100 and report["served"] > 0, report


def test_a_hang_names_its_input_and_tells_a_stalled_server_from_a_starved_process():
    """A request not answered in time is recorded with its class, and a server loop blocked by a call
    (the GIL released: the rest of the process runs on) is told apart from a starved process."""
    target = HttpTarget()
    try:
        # Something on the server's loop blocks it past HANG_S; time.sleep lets this process's threads run.
        target._loop.loop.call_soon_threadsafe(time.sleep, HANG_S + 1.5)
        target.send(random.Random(3), b"{}")
        assert target.probe()  # after that input is settled: by then the loop runs again
        records = target.hang_records
        assert target.counts["hangs"] == 1 and len(records) == 1, records
        record = records[0]
        assert record["input"].split()[0] in METHODS and "body=" in record["input"], record
        assert record["phase"] == "answer" and record["waited_s"] >= HANG_S, record
        assert record["verdict"] == "server loop stalled", record
        assert record["server_loop_late_s"][0] >= HANG_S - 0.5 > 1.0 > record["fuzz_thread_late_s"][0], record
        assert record["retry"].endswith(" s") and not record["retry"].startswith("hang"), record  # answered once free
    finally:
        target.close()


@pytest.mark.parametrize(("loop", "thread", "retry", "verdict"), [
    ((4.8, 4.8), (4.7, 4.7), "200 in 0.01 s", "process starved"),
    ((0.2, 3.0), (0.2, 2.9), "hang (answer)", "process starved"),
    ((4.8, 4.8), (0.01, 0.05), "200 in 0.01 s", "server loop stalled"),
    ((0.05, 0.2), (1.5, 2.0), "200 in 0.01 s", "fuzz client starved"),
    ((0.05, 0.2), (0.05, 0.2), "hang (answer)", "server holds the request"),
    ((0.05, 0.2), (0.05, 0.2), "400 in 0.02 s", "unexplained: no lag, answered on retry"),
])
def test_hang_verdicts(loop, thread, retry, verdict):
    record = {"waited_s": 5.0, "server_loop_late_s": list(loop), "fuzz_thread_late_s": list(thread), "retry": retry}
    assert hang_verdict(record) == verdict
