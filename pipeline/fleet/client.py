"""A page of the fleet, as an aiortc client: admitted by the front door, media from its node.

It reserves a session (``POST /session``; a "full" answer raises ``SignalingError`` 503 with
the ``retry_after`` seconds), connects an ``EgressClient`` through the front door (which hands
the offer to the session's node) and listens to the front door's event stream, which is how it
hears that its session ended when the node that served it is gone.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from charstream.pipeline.web.client import EgressClient, SignalingError


class FullError(SignalingError):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(503, message)
        self.retry_after = retry_after


class FleetClient:
    def __init__(self, url: str, key: str) -> None:
        self.url = url
        self.key = key
        self.media = EgressClient()
        self.session_id: str | None = None
        self.token: str | None = None
        self.ended: str | None = None  # the front door's reason, once the session ended
        self.ended_event = asyncio.Event()
        self._http = aiohttp.ClientSession()
        self._listener: asyncio.Task | None = None

    async def reserve(self) -> None:
        async with self._http.post(f"{self.url}/session", headers={"X-Charstream-Key": self.key}) as r:
            data = await r.json()
            if r.status == 503:
                raise FullError(data.get("error", ""), float(r.headers.get("Retry-After", "0")))
            if r.status != 200:
                raise SignalingError(r.status, data.get("error", ""))
        self.session_id, self.token = data["session_id"], data["token"]
        response = await self._http.get(f"{self.url}{data['events']}")
        if response.status != 200:
            raise SignalingError(response.status, "no event stream")
        self._listener = asyncio.create_task(self._listen(response))

    async def connect(self) -> None:
        await self.media.connect(self.url, self.token)

    async def hangup(self) -> None:
        async with self._http.post(f"{self.url}/hangup", json={"token": self.token}) as r:
            if r.status != 200:
                raise SignalingError(r.status, (await r.json()).get("error", ""))

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        await self.media.close()
        await self._http.close()

    async def _listen(self, response: aiohttp.ClientResponse) -> None:
        async with response:
            async for line in response.content:
                if line.startswith(b"data: "):
                    msg = json.loads(line[6:])
                    if msg.get("type") == "end":
                        self.ended = msg.get("reason", "")
                        self.ended_event.set()
                        return
