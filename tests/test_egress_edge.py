"""The signaling edge under hostile HTTP: each input a probe found, sent exactly, over a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from waiting import until

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import EgressClient
from charstream.pipeline.web.server import EgressServer
from charstream.stages.config import EgressConfig


async def raw_request(url: str, data: bytes, read_timeout: float = 10.0) -> tuple[int | None, bytes]:
    """Send ``data`` as-is on a fresh connection; (status or None if closed without one, body)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(read_timeout):
            response = await reader.read()
    finally:
        writer.close()
    if not response:
        return None, b""
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def post(path: str, body: bytes, host: bytes = b"127.0.0.1", headers: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
            + headers + b"\r\n" + body)


def run(config: EgressConfig, scenario):
    async def main():
        server = EgressServer(config, session_factory(PipelineConfig(), testcard=True), access_key="k")
        url = await server.start()
        try:
            return await scenario(server, url)
        finally:
            await server.stop()

    return asyncio.run(main())


def test_a_non_ascii_key_header_is_403_not_500():
    async def scenario(server, url):
        return await raw_request(url, post("/session", b"{}", headers="X-Charstream-Key: kä\r\n".encode()))

    status, body = run(EgressConfig(port=0), scenario)
    assert status == 403 and b"X-Charstream-Key" in body


@pytest.mark.parametrize("body, expected", [
    (b"[" * 100_000 + b"]" * 100_000, b"nested too deep"),
    (b'{"token": ' + b"1" * 200_000 + b"}", b"number of 200000 characters"),
    (b'{"token": NaN}', b"NaN is not JSON"),
], ids=["nested 100,000 deep", "200,000-digit number", "NaN"])
def test_json_beyond_the_limits_is_400_on_every_endpoint(body, expected):
    async def scenario(server, url):
        return [await raw_request(url, post(path, body)) for path in ("/offer", "/hangup", "/code")]

    for status, text in run(EgressConfig(port=0), scenario):
        assert status == 400 and expected in text, text[:200]


def test_a_foreign_host_header_is_refused_dns_rebinding():
    async def scenario(server, url):
        port = url.rsplit(":", 1)[1].encode()
        out = {}
        for name, host in [("evil", b"evil.example"), ("evil_with_port", b"evil.example:" + port),
                           ("localhost", b"localhost:" + port), ("ip", b"127.0.0.1:" + port),
                           ("ipv6", b"[::1]:" + port), ("allowed", b"Box.LAN:" + port)]:
            out[name] = (await raw_request(url, post("/session", b"{}", host, b"X-Charstream-Key: k\r\n")))[0]
            await server.close_session(next(iter(server.sessions), ""), "test")
        get_page = b"GET / HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
        out["page"] = (await raw_request(url, get_page))[0]
        return out

    out = run(EgressConfig(port=0, allowed_hosts=["box.lan"]), scenario)
    assert out == {"evil": 403, "evil_with_port": 403, "page": 403,
                   "localhost": 200, "ip": 200, "ipv6": 200, "allowed": 200}


def test_slow_connections_are_closed():
    async def scenario(server, url):
        started = time.monotonic()
        headers_never_end = raw_request(url, b"POST /session HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1")
        body_never_ends = raw_request(url, post("/offer", b'{"token": "t", "sdp": "v=0"}')[:-10])
        results = await asyncio.gather(headers_never_end, body_never_ends,
                                       *(raw_request(url, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n") for _ in range(50)))
        return results, time.monotonic() - started

    results, took = run(EgressConfig(port=0, idle_timeout_s=0.5, body_timeout_s=0.5), scenario)
    assert results[0] == (None, b"")  # closed without a response
    assert results[1][0] == 408 and b"not received within 0.5 s" in results[1][1]
    assert all(status is None for status, _ in results[2:])  # 50 idle connections, all closed
    assert took < 5


def test_one_client_cannot_hold_every_reservation_or_renew_without_limit():
    async def reserve(url):
        return await raw_request(url, post("/session", b"{}", headers=b"X-Charstream-Key: k\r\n"))

    async def release(server):  # as if they expired (or were offered): the per-client slots are free again
        for session_id in list(server.sessions):
            await server.close_session(session_id, "test")

    async def scenario(server, url):
        out = {"held": [(await reserve(url))[0] for _ in range(3)]}
        out["third"] = json.loads((await reserve(url))[1])["error"]
        await release(server)
        out["renewed"] = [(await reserve(url))[0] for _ in range(2)]
        await release(server)
        out["past_rate"] = json.loads((await reserve(url))[1])["error"]
        out["in_process"] = server.create_session()  # the caps are per network client
        return out

    out = run(EgressConfig(port=0, reservations_per_client=2, reservations_per_minute=4), scenario)
    assert out["held"] == [200, 200, 429] and "already holds 2 reservations" in out["third"]
    assert out["renewed"] == [200, 200] and "4 reservations in the last minute" in out["past_rate"]
    assert out["in_process"]


def test_a_one_time_code_gives_the_key_once():
    async def scenario(server, url):
        code = server.issue_code()
        first = await raw_request(url, post("/code", json.dumps({"code": code}).encode()))
        again = await raw_request(url, post("/code", json.dumps({"code": code}).encode()))
        wrong = await raw_request(url, post("/code", b'{"code": 7}'))
        return first, again, wrong

    first, again, wrong = run(EgressConfig(port=0), scenario)
    assert first == (200, b'{"key": "k"}') and again[0] == 403 and wrong[0] == 403


# --- one address, every slot; a large offer; a response nobody reads; floods of refusals ---------------------

def test_one_address_opening_page_after_page_leaves_slots_for_another_client():
    """One address reserved and connected session after session until the server was full (the cap
    counted only reservations without an offer); another address then got 503."""

    async def reserve(url, address):  # a page's reservation, from ``address`` (127.0.0.x reach the loopback listener)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(address, 0))
        writer.write(post("/session", b"{}", headers=b"X-Charstream-Key: k\r\n"))
        response = await reader.read()
        writer.close()
        head, _, body = response.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), json.loads(body)

    async def scenario(server, url):
        clients, statuses = [], []
        for _ in range(12):  # pages opened at once by one address: each that gets a token connects
            status, body = await reserve(url, "127.0.0.2")
            statuses.append(status)
            if status == 200:
                clients.append(EgressClient())
                await clients[-1].connect(url, body["token"])
        other_status, other = await reserve(url, "127.0.0.3")
        other_client = EgressClient()
        if other_status == 200:
            await other_client.connect(url, other["token"])
            await other_client.wait_for_video(12, timeout=30)
        for client in [*clients, other_client]:
            await client.close()
        return statuses, other_status, other_client.video_frames

    statuses, other_status, other_frames = run(EgressConfig(port=0, max_sessions=6), scenario)
    assert statuses.count(200) == 4 and set(statuses[4:]) == {429}, statuses  # sessions_per_client's default
    assert other_status == 200 and other_frames >= 12


def offer_with_candidates(count: int, port: int) -> str:
    """A real aiortc offer (audio, video, data channel) listing ``count`` more host candidates, all
    at 127.0.0.1: the first at ``port``, the rest at the ports after it."""
    from aiortc import RTCPeerConnection

    async def make() -> str:
        pc = RTCPeerConnection()
        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver("audio", direction="recvonly")
        pc.createDataChannel("timing")
        await pc.setLocalDescription(await pc.createOffer())
        text = pc.localDescription.sdp
        await pc.close()
        return text

    text = asyncio.run(make())
    extra = "".join(f"a=candidate:{9000 + i} 1 udp {2130706431 - i} 127.0.0.1 {port + i} typ host\r\n"
                    for i in range(count))
    first_media = text.index("m=", text.index("m=") + 1)  # after the first media section's lines
    return text[:first_media] + extra + text[first_media:]


def test_an_offer_listing_thousands_of_candidates_is_refused_without_stalling_or_probing_them():
    """3,000 candidates (178 KB) held the loop ~2 s and made the server send STUN to each address."""
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.setblocking(False)
    sdp_text = offer_with_candidates(3000, listener.getsockname()[1])

    async def scenario(server, url):
        _, token = server.create_session()
        body = json.dumps({"token": token, "sdp": sdp_text, "type": "offer"}).encode()
        offer = asyncio.create_task(raw_request(url, post("/offer", body)))
        page_s = []
        while not offer.done():  # the page keeps loading while the offer is handled
            started = time.monotonic()
            await raw_request(url, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            page_s.append(time.monotonic() - started)
        await asyncio.sleep(1.0)  # connectivity checks would have started by now
        return await offer, max(page_s)

    (status, text), slowest_page = run(EgressConfig(port=0), scenario)
    probed = []
    try:
        while True:
            probed.append(listener.recv(2048))
    except BlockingIOError:
        pass
    listener.close()
    assert len(sdp_text) > 170_000
    assert status == 400 and (b"ICE candidates" in text or b"characters" in text), text[:200]
    assert probed == [] and slowest_page < 0.5, (len(probed), slowest_page)


def test_an_offer_over_the_candidate_cap_is_refused_and_one_under_it_accepted():
    offers = [offer_with_candidates(count, 9) for count in (40, 20)]

    async def scenario(server, url):
        out = []
        for text in offers:
            _, token = server.create_session()
            body = json.dumps({"token": token, "sdp": text, "type": "offer"}).encode()
            out.append(await raw_request(url, post("/offer", body)))
        return out

    (over, over_text), (under, _) = run(EgressConfig(port=0), scenario)
    assert over == 400 and b"offer lists 4" in over_text and b"ICE candidates (most 32)" in over_text
    assert under == 200


def test_a_client_that_never_reads_its_responses_is_dropped():
    """Pipelined page requests, never read: the server's writes waited on a full socket for good."""
    import socket

    async def scenario(server, url):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect((host, int(port)))
        sock.setblocking(False)
        request = b"GET /static/app.js HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        async def send() -> None:  # the server stops reading once its writes wait: this may never finish
            with contextlib.suppress(OSError):
                await asyncio.get_running_loop().sock_sendall(sock, request * 2000)  # ~20 MB asked for, none read

        sender = asyncio.create_task(send())
        await asyncio.sleep(0.5)
        dropped = await until(lambda: not server._runner.server.connections, timeout=6)  # (a fresh list each time)
        sender.cancel()
        sock.close()
        return dropped

    assert run(EgressConfig(port=0, write_timeout_s=0.5, idle_timeout_s=30), scenario)


SERVE_FROM_A_PROCESS = """
import asyncio, sys
from charstream.logs import configure_logging
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
from charstream.stages.config import EgressConfig
from charstream.pipeline.web.server import EgressServer

async def main():
    configure_logging()
    server = EgressServer(EgressConfig(port=0), session_factory(PipelineConfig(), testcard=True), access_key="k")
    print(await server.start(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    await server.stop()

asyncio.run(main())
"""


def test_a_flood_of_malformed_requests_logs_a_few_json_lines_not_a_traceback_each():
    """20,000 malformed requests (no key needed) wrote 4,894 plaintext tracebacks, 4 MB of stderr."""
    import socket
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", SERVE_FROM_A_PROCESS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = int(server.stdout.readline().rsplit(b":", 1)[1])
        bad = [b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
               b"POST /offer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
               b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n"]
        for i in range(2000):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(bad[i % len(bad)])
                s.recv(4096)
        _, err = server.communicate(b"", timeout=60)
    finally:
        server.kill()
    lines = err.decode().splitlines()
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    handled = [e for e in events if e["event"].startswith("Error handling request")]
    assert 0 < len(handled) <= 3 * 10 and len(err) < 50_000, (len(handled), len(err))


def test_a_flood_of_malformed_data_channel_messages_logs_a_few_lines(capsys):
    async def scenario(server, url):
        _, token = server.create_session()
        client = EgressClient()
        await client.connect(url, token)
        await client.wait_for_video(6, timeout=30)
        session = next(iter(server.sessions.values()))
        for i in range(300):
            client.channel.send(f"not json {i}")
        received = await until(lambda: session.bad_messages >= 300, timeout=20)
        await client.close()
        await asyncio.sleep(0.5)  # the log writer's thread catches up
        return received

    assert run(EgressConfig(port=0), scenario)
    logged = [line for line in capsys.readouterr().err.splitlines() if "datachannel_message_dropped" in line]
    assert 0 < len(logged) <= 10, len(logged)
