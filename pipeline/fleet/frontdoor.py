"""The fleet's front door: signaling for many nodes; each session reserved on one node of a Ray cluster.

``FrontDoor`` is an ``EgressServer`` (the same page, one-time codes, Host checks, body limits and
per-client reservation caps) whose sessions run elsewhere:

* ``POST /session`` (``X-Charstream-Key``) admits a session: it picks the node with the most free
  layouts (not draining, under ``max_sessions_per_node``), reserves the session's layout there as
  a STRICT_PACK placement group, starts a ``SessionHost`` actor in it and returns ``{"session_id",
  "token", "events"}``. No node fits: 503 with ``Retry-After`` at once; a reservation or start
  that fails is undone before the answer (never a half-started session).
* ``POST /offer`` and ``POST /hangup`` go to the session's node egress and its answer comes back
  as is, so media flows between the page and that node.
* ``GET /events?token=`` — a server-sent event stream that says ``{"type": "end", "reason"}``
  when the session ends, however it ends: the one way a page hears that its node died.
* ``GET /fleet/status`` and ``POST /fleet/drain {"node"}`` (key required), ``GET /metrics``.

A session's placement group and actor are released when it ends: hangup, the peer gone, its
pipeline ended, the offer never came, or its node lost (Ray reports the actor dead; the node
poll sees the node dead). Every other session is untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import ray
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.fleet.health import FleetHealth
from charstream.pipeline.fleet.host import SessionHost
from charstream.pipeline.fleet.layout import layouts_that_fit, session_bundles, session_demand, session_layout
from charstream.pipeline.fleet.metrics import FleetCollector
from charstream.pipeline.web.server import EgressServer, OfferError

log = structlog.get_logger("fleet")
NODE_LABEL = "ray.io/node-id"  # every Ray node carries its id as this label
SIGNALING_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
MAX_EVENT_STREAMS = 2  # per session: each holds a connection until the session ends
PLACED_POLL_S = 0.01


class Full(Exception):
    """No node can take the session's layout now."""


@dataclass
class NodeState:
    node_id: str
    resources: dict[str, float]  # the node's totals
    alive: bool = True
    draining: bool = False
    sessions: set[str] = field(default_factory=set)  # admitted here (starting or running)


@dataclass
class SessionRecord:
    """The front door's record of a session placed on a node: its reservation, actor and health."""

    session_id: str
    token: str
    node_id: str
    placement_group: PlacementGroup
    actor: Any
    url: str  # the node egress
    client: str | None  # the address that reserved it (held to the per-client caps)
    state: str = "reserved"  # reserved -> active (its offer went to the node)
    played_s: float = 0.0
    average_fps: float | None = None  # fresh frames per second at playout: what fleet health counts
    presented_fps: float | None = None  # frames per second the page reported presenting
    end_reason: str | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    event_streams: int = 0  # open /events streams (a page's, and one it reconnected)
    watcher: asyncio.Task | None = None  # ends by itself: the actor's end, or its death once released


@ray.remote(num_cpus=0)
def bundle_gpu_ids() -> list[str]:
    """The GPUs Ray gave this placement-group bundle (run in it)."""
    return [str(i) for i in ray.get_gpu_ids()]


class FrontDoor(EgressServer):
    def __init__(self, config: PipelineConfig, source: str, access_key: str | None = None) -> None:
        super().__init__(config.egress, _sessions_run_on_nodes, access_key)
        self.pipeline_config = config
        self.fleet = config.fleet
        self.source = source
        session_layout(self.fleet)  # fail fast on an unknown layout
        self.bundles = session_bundles(self.fleet)
        self.demand = session_demand(self.fleet)
        self.nodes: dict[str, NodeState] = {}
        self.sessions: dict[str, SessionRecord] = {}  # type: ignore[assignment]  # they run on the nodes
        self._by_token: dict[str, SessionRecord] = {}  # type: ignore[assignment]
        self.health = FleetHealth(self.fleet)
        self.admissions = {"admitted": 0, "full": 0, "failed": 0}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(FleetCollector(self))
        self._actor_class = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=64)(SessionHost)
        self._http: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None
        self.app.add_routes([
            web.get("/events", self._events),
            web.get("/fleet/status", self._status),
            web.post("/fleet/drain", self._drain),
            web.get("/metrics", self._metrics),
        ])

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        await self._refresh_nodes()
        self._http = aiohttp.ClientSession()
        self._poller = asyncio.create_task(self._poll_forever(), name="fleet-poll")
        url = await super().start()
        log.info("fleet_front_door_listening", url=url, layout=self.fleet.layout, bundles=self.bundles,
                 nodes=len(self.nodes))
        return url

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await asyncio.gather(*(self.close_session(s, "server stopping") for s in list(self.sessions)))
        await super().stop()
        if self._http is not None:
            await self._http.close()

    async def close_session(self, session_id: str, reason: str) -> None:
        """End a session from here: its node stops it, then its reservation is released."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        try:
            await asyncio.wait_for(_awaitable(session.actor.stop.remote(reason)), STOP_TIMEOUT_S)
        except (RayActorError, TimeoutError):
            pass
        await self._release(session, reason)

    # --- admission ---------------------------------------------------------------------------

    def free_layouts(self, node: NodeState) -> int:
        if not node.alive or node.draining:
            return 0
        taken = {name: amount * len(node.sessions) for name, amount in self.demand.items()}
        free = {name: node.resources.get(name, 0.0) - taken[name] for name in self.demand}
        return max(min(layouts_that_fit(free, self.demand), self.fleet.max_sessions_per_node - len(node.sessions)), 0)

    def pick_node(self) -> NodeState:
        """The node with the most free layouts (then the fewest sessions): sessions spread by capacity."""
        candidates = [n for n in self.nodes.values() if self.free_layouts(n) > 0]
        if not candidates:
            raise Full(f"fleet full: no node has a free {self.fleet.layout} layout")
        return max(candidates, key=lambda n: (self.free_layouts(n), -len(n.sessions), n.node_id))

    async def admit(self, client: str | None = None) -> SessionRecord:
        node = self.pick_node()  # raises Full: no Ray call on the way to a 503
        if client is not None:
            self._admit(client)  # the per-client caps (OfferError 429)
        placeholder = secrets.token_hex(8)
        node.sessions.add(placeholder)  # held before the first await: concurrent admissions see it
        pg, actor = None, None
        try:
            pg = placement_group(self.bundles, strategy="STRICT_PACK", bundle_label_selector=[
                {NODE_LABEL: node.node_id}] * len(self.bundles))
            if not await _placed(pg, self.fleet.reserve_timeout_s):
                raise Full(f"node {node.node_id[:12]} could not reserve a {self.fleet.layout} layout in time")
            gpu_ids = await self._bundle_gpus(pg) if "GPU" in self.demand else []
            decoder = len(self.bundles) - 1
            actor = self._actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=decoder)).remote(self.pipeline_config, self.source)
            info = await asyncio.wait_for(_awaitable(actor.start.remote(gpu_ids)), self.fleet.start_timeout_s)
        except BaseException:
            node.sessions.discard(placeholder)
            if actor is not None:
                ray.kill(actor)
            if pg is not None:
                await asyncio.to_thread(remove_placement_group, pg)
            raise
        node.sessions.discard(placeholder)
        node.sessions.add(info["session_id"])
        session = SessionRecord(info["session_id"], info["token"], node.node_id, pg, actor, info["url"], client)
        self.sessions[session.session_id] = session
        self._by_token[session.token] = session
        session.watcher = asyncio.create_task(self._watch(session), name=f"fleet-watch-{session.session_id}")
        log.info("fleet_session_admitted", session_id=session.session_id, node=node.node_id[:12], egress=session.url)
        return session

    async def _bundle_gpus(self, pg: PlacementGroup) -> list[str]:
        probes = [bundle_gpu_ids.options(num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote() for i, b in enumerate(self.bundles) if "GPU" in b]
        ids = await asyncio.wait_for(asyncio.gather(*map(_awaitable, probes)), self.fleet.start_timeout_s)
        return [gpu for bundle in ids for gpu in bundle]

    # --- session ends ------------------------------------------------------------------------

    async def _watch(self, session: SessionRecord) -> None:
        try:
            result = await _awaitable(session.actor.ended.remote())
            session.played_s, session.average_fps = result["played_s"], result["average_fps"]
            session.presented_fps = result["presented_fps"]
            reason = result["reason"] or "session ended"
        except RayActorError as e:
            # The actor can die before Ray marks its node dead: a lost node, once seen, releases its
            # sessions with that reason; only past the grace is it the session's process alone.
            deadline = time.monotonic() + self.fleet.node_loss_grace_s
            while session.session_id in self.sessions and time.monotonic() < deadline:
                await self._refresh_nodes()
                await asyncio.sleep(self.fleet.poll_interval_s)
            reason = f"the session's process died: {type(e).__name__}"
        await self._release(session, reason)

    async def _release(self, session: SessionRecord, reason: str) -> None:
        """Free the session's reservation and tell its page why it ended (idempotent)."""
        if self.sessions.pop(session.session_id, None) is None:
            return
        self._by_token.pop(session.token, None)
        node = self.nodes.get(session.node_id)
        if node is not None:
            node.sessions.discard(session.session_id)
        ray.kill(session.actor)
        await asyncio.to_thread(remove_placement_group, session.placement_group)
        self.health.record_ended(session.played_s, session.average_fps)
        session.end_reason = reason
        session.ended.set()
        log.info("fleet_session_ended", session_id=session.session_id, node=session.node_id[:12], reason=reason,
                 average_fps=session.average_fps, played_s=round(session.played_s, 1))

    # --- polling: node liveness, session figures ---------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.fleet.poll_interval_s)
            try:
                await self._refresh_nodes()
                await self.refresh_figures()
            except Exception:  # a failed poll must not stop the next one
                log.exception("fleet_poll_failed")

    async def _refresh_nodes(self) -> None:
        for info in await asyncio.to_thread(ray.nodes):
            node_id = info["NodeID"]
            node = self.nodes.get(node_id)
            if node is None:
                if not info["Alive"]:
                    continue
                node = self.nodes[node_id] = NodeState(node_id, dict(info["Resources"]))
                log.info("fleet_node_joined", node=node_id[:12], resources=node.resources,
                         layouts=self.free_layouts(node))
            if node.alive and not info["Alive"]:
                node.alive = False
                lost = [s for s in self.sessions.values() if s.node_id == node_id]
                log.warning("fleet_node_lost", node=node_id[:12], sessions=len(lost))
                await asyncio.gather(*(self._release(s, f"the session's node {node_id[:12]} was lost")
                                       for s in lost))

    async def refresh_figures(self) -> None:
        live = list(self.sessions.values())
        results = await asyncio.gather(*(asyncio.wait_for(_awaitable(s.actor.figures.remote()), 2.0) for s in live),
                                       return_exceptions=True)
        for session, figures in zip(live, results, strict=True):
            if isinstance(figures, dict):
                session.played_s, session.average_fps = figures["played_s"], figures["average_fps"]
                session.presented_fps = figures["presented_fps"]

    # --- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        figures = self.health.figures([(s.played_s, s.average_fps) for s in self.sessions.values()])
        return {
            "layout": self.fleet.layout, "bundles": self.bundles,
            "nodes": [{"node_id": n.node_id, "state": _node_state(n), "sessions": len(n.sessions),
                       "free_layouts": self.free_layouts(n), "resources": n.resources}
                      for n in sorted(self.nodes.values(), key=lambda n: n.node_id)],
            "sessions": [{"session_id": s.session_id, "node_id": s.node_id, "egress": s.url,
                          "played_s": round(s.played_s, 1),
                          "average_fps": None if s.average_fps is None else round(s.average_fps, 2),
                          "presented_fps": None if s.presented_fps is None else round(s.presented_fps, 2)}
                         for s in self.sessions.values()],
            "health": {**dataclasses.asdict(figures), "slow_share": figures.slow_share},
            "admissions": dict(self.admissions),
        }

    def drain(self, node_prefix: str) -> NodeState:
        matches = [n for n in self.nodes.values() if n.node_id.startswith(node_prefix)]
        if len(matches) != 1:
            raise ValueError(f"{len(matches)} nodes match {node_prefix!r}; give more of the node id")
        matches[0].draining = True
        log.info("fleet_node_draining", node=matches[0].node_id[:12], sessions=len(matches[0].sessions))
        return matches[0]

    # --- handlers ----------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("X-Charstream-Key", "").encode("utf-8", "surrogateescape")
        return secrets.compare_digest(given, self.access_key.encode())

    async def _create_session(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(403, "wrong or missing X-Charstream-Key")
        try:
            session = await self.admit(request.remote or "?")
        except Full as e:
            self.admissions["full"] += 1
            return _error(503, str(e), headers={"Retry-After": str(self.fleet.retry_after_s)})
        except OfferError as e:
            log.warning("reservation_refused", status=e.status, error=str(e))
            return _error(e.status, str(e))
        except Exception as e:
            self.admissions["failed"] += 1
            log.exception("fleet_session_start_failed")
            return _error(500, f"session start failed: {type(e).__name__}: {e}")
        self.admissions["admitted"] += 1
        return web.json_response({"session_id": session.session_id, "token": session.token,
                                  "events": f"/events?token={session.token}"})

    async def _offer(self, request: web.Request) -> web.Response:
        return await self._forward(request, "offer")

    async def _hangup(self, request: web.Request) -> web.Response:
        return await self._forward(request, "hangup")

    async def _forward(self, request: web.Request, path: str) -> web.Response:
        """Hand the page's request to its session's node egress; its answer comes back as is."""
        try:
            body, session = await self._token_request(request)
        except OfferError as e:
            return _error(e.status, str(e))
        session.state = "active"
        try:
            async with self._http.post(f"{session.url}/{path}", json=body,
                                       timeout=aiohttp.ClientTimeout(total=SIGNALING_TIMEOUT_S)) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as e:
            return _error(502, f"the session's node did not answer: {type(e).__name__}: {e}")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        session = self._by_token.get(request.query.get("token", ""))
        if session is None:
            return _error(404, "unknown or ended session")
        if session.event_streams >= MAX_EVENT_STREAMS:
            return _error(429, f"the session already has {session.event_streams} event streams")
        session.event_streams += 1
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            await response.write(b": admitted\n\n")
            await session.ended.wait()
            await response.write(f"data: {json.dumps({'type': 'end', 'reason': session.end_reason})}\n\n".encode())
        except ConnectionResetError:  # the page left first
            pass
        finally:
            session.event_streams -= 1
        return response

    async def _status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(403, "wrong or missing X-Charstream-Key")
        return web.json_response(self.status())

    async def _drain(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _error(403, "wrong or missing X-Charstream-Key")
        try:
            node = self.drain(str((await self._json_body(request)).get("node", "")))
        except OfferError as e:
            return _error(e.status, str(e))
        except ValueError as e:
            return _error(400, str(e))
        return web.json_response({"node_id": node.node_id, "state": _node_state(node), "sessions": len(node.sessions)})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _sessions_run_on_nodes(session_id: str):
    raise RuntimeError("a fleet front door runs no session itself: each runs on a node (SessionHost)")


def _loopback_host(address: str) -> str | None:
    host = address.rsplit(":", 1)[0]
    try:
        return host if ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # "auto" or a host name
        return None


def _node_state(node: NodeState) -> str:
    return "dead" if not node.alive else "draining" if node.draining else "alive"


async def _placed(pg: PlacementGroup, timeout: float) -> bool:
    """Whether ``pg`` is placed within ``timeout`` (``pg.wait`` counts whole seconds only)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(pg.wait, 0):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(PLACED_POLL_S)
    return True


def _awaitable(ref: ray.ObjectRef) -> asyncio.Future:
    return asyncio.wrap_future(ref.future())


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def join_cluster(address: str) -> None:
    """Connect this process to the Ray cluster at ``address`` ('auto': the one this host belongs to).

    A cluster on a loopback address (``fleet/cluster.py``) is joined from that address; Ray's
    own guess would be the host's outbound one, where a loopback cluster is not.
    """
    ray.init(address=address, namespace="charstream", log_to_driver=False, logging_level="warning",
             _node_ip_address=_loopback_host(address))
