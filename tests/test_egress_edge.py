"""The signaling edge under hostile HTTP: each input a probe found, sent exactly, over a real socket."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
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
