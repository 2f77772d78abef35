"""One live character session: the stage graph of docs/ARCHITECTURE.md (Stages) run by ``pipeline.runner``.

    ingest ─► conditioning ─► diffusion ─► decode ─► playout ─► (PlayoutOutput) ─► WebRTC tracks
                                                                  egress node ◄─► PeerLink ◄─► peer connection

or, with ``testcard=True`` (no model): card ─► playout, the same egress node.

Ingest, conditioning and playout live in the caller's process (group ``main``: asyncio, next to
egress); diffusion and decode get process groups of their own, which ``hosting = "processes"``
spawns and ``"inproc"`` (the CPU demo, tests) keeps in one process -- except a stage whose sessions
share a batcher (``diffusion/decode.batch_sessions`` > 1), which runs in the caller's process with
it. ``"engine"``: conditioning, diffusion and decode are hosted by a running model engine
(``pipeline/runtime/engine.py``) with its batchers, so this process makes no CUDA context. The session owns the live objects its nodes share — playout's ``PlayoutOutput`` (what egress
serves to the peer connection), the microphone queue, the tracer, a pushed agent adapter, the peer
link, the batchers — and hands each to its nodes explicitly; ``session_factory`` is what the egress server calls for each new peer.

The user's microphone (a browser's, through egress) is fed to ingest's VAD, except with the
scripted agent, which plays the user itself. Each session owns a ``TurnTracer``: playout merges
the first speaking frame's trace into it, egress the client's report; it writes the turn to the
trace JSONL and exports OpenTelemetry spans.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.process import MODEL_STAGES, prepare_process
from charstream.pipeline.runtime.runner import (
    ENGINE_GROUP,
    LOCAL_GROUP,
    Edge,
    Graph,
    Node,
    SessionResult,
    SessionRunner,
)
from charstream.pipeline.web.server import SessionFactory, SessionMedia
from charstream.stages.base import Stage
from charstream.stages.conditioning.batcher import EncodeBatcher
from charstream.stages.conditioning.stage import build as build_conditioning
from charstream.stages.decode.batcher import DecodeBatcher
from charstream.stages.decode.chunks import ChunkDecodeStage
from charstream.stages.decode.stage import DecodeStage
from charstream.stages.diffusion.batcher import StepBatcher
from charstream.stages.diffusion.chunks import ChunkDiffusionStage
from charstream.stages.diffusion.stage import DiffusionStage
from charstream.stages.egress.mic import UserAudioQueue
from charstream.stages.egress.stage import EgressStage, PeerLink
from charstream.stages.egress.testcard import CardSource
from charstream.stages.ingest.adapters import PUSH_ADAPTERS, AgentAdapter
from charstream.stages.ingest.external import AgentHub, ExternalAgent
from charstream.stages.ingest.push import PushAdapter
from charstream.stages.ingest.stage import IngestStage
from charstream.stages.playout.output import PlayoutOutput
from charstream.stages.playout.stage import PlayoutStage
from charstream.stages.shared.chunk_batcher import ChunkDecodeBatcher, ChunkDenoiseBatcher
from charstream.stages.shared.metrics import forget_processes
from charstream.stages.shared.tracing import TurnRecord, TurnTracer

if TYPE_CHECKING:
    from charstream.model.families.base import ModelFamily
    from charstream.model.families.flashhead.chunks import ChunkRunner


def model_nodes(config: PipelineConfig, weights: str | None = "packaged",
                batcher: StepBatcher | ChunkDenoiseBatcher | None = None,
                decode_batcher: DecodeBatcher | ChunkDecodeBatcher | None = None, family: ModelFamily | None = None,
                portrait: np.ndarray | None = None, encode_batcher: EncodeBatcher | None = None) -> list[Node]:
    """The model stages (conditioning, diffusion, decode), each built from its config
    section. Their process groups: the caller's (``main``) for conditioning and for a stage with the
    process's shared ``batcher`` / ``decode_batcher``, else ``diffusion`` / ``decoder``; all three
    ``engine`` in ``hosting = "engine"`` (the engine builds them itself, with its batchers).

    ``family``: the session's model (default: the one ``config.preset`` names). A ``chunk_motion`` family
    (FlashHead) runs its chunk stages over one chunk stream made here from ``portrait`` (RGB uint8),
    all three in the caller's process (``inproc``), with the process's chunk batchers and its
    ``encode_batcher`` when given."""
    from charstream.model.families import get_family

    family = family or get_family(config.preset)
    if family.generation_mode == "chunk_motion":
        return chunk_nodes(config, family, weights, portrait, batcher, decode_batcher, encode_batcher)
    model = {"preset": config.preset, "weights": weights}
    diffusion = Node("diffusion", DiffusionStage, dict(model, config=config.diffusion), group="diffusion")
    if batcher is not None:
        diffusion = Node("diffusion", DiffusionStage, dict(diffusion.kwargs, batcher=batcher))
    decode = Node("decode", DecodeStage, dict(model, config=config.decode, seed=config.diffusion.seed), group="decoder")
    if decode_batcher is not None:
        decode = Node("decode", DecodeStage, dict(decode.kwargs, batcher=decode_batcher))
    nodes = [Node("conditioning", build_conditioning, dict(model, config=config.conditioning, seed=config.diffusion.seed)),
             diffusion, decode]
    if config.hosting == "engine":
        nodes = [Node(n.name, n.factory, n.kwargs, ENGINE_GROUP) for n in nodes]
    return nodes


class SessionStream:
    """A ``chunk_motion`` session's one chunk stream (``family.chunk_stream``), which its diffusion and decode
    stages share: made by the first of them built, in the process that runs them (this one, or the model
    engine that hosts them: there the front-end's holds only the ``portrait`` its host request carries)."""

    def __init__(self, family: ModelFamily, weights: str | None, portrait: np.ndarray, device: str, seed: int) -> None:
        self.portrait = portrait
        self._make = functools.partial(family.chunk_stream, weights, portrait, device, seed)
        self._stream: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._stream is None:
                self._stream = self._make()
            return self._stream


def chunk_diffusion(stream: SessionStream, **kwargs: Any) -> ChunkDiffusionStage:
    return ChunkDiffusionStage(stream=stream.get(), **kwargs)


def chunk_decode(stream: SessionStream, **kwargs: Any) -> ChunkDecodeStage:
    return ChunkDecodeStage(stream=stream.get(), **kwargs)


def chunk_nodes(config: PipelineConfig, family: ModelFamily, weights: str | None, portrait: np.ndarray | None,
                batcher: ChunkDenoiseBatcher | None = None, decode_batcher: ChunkDecodeBatcher | None = None,
                encode_batcher: EncodeBatcher | None = None) -> list[Node]:
    """Conditioning, diffusion and decode of a ``chunk_motion`` family: the family's audio conditioner, then
    one chunk stream (``SessionStream``) shared by the chunk diffusion and decode stages; all three in the
    caller's process (``inproc``) or a model engine's (``engine``), never apart."""
    if portrait is None:
        raise ValueError(f"model {family.name!r} animates a portrait: give one (--portrait IMAGE)")
    if config.hosting not in ("inproc", "engine"):
        raise ValueError(f"model {family.name!r} runs its model stages in one process (hosting inproc or engine), "
                         f"not hosting {config.hosting!r}")
    weights = None if weights in (None, "random") else weights
    seed = config.diffusion.seed
    stream = SessionStream(family, weights, portrait, config.diffusion.device, seed)
    cfg = family.config
    group = ENGINE_GROUP if config.hosting == "engine" else LOCAL_GROUP
    return [Node("conditioning", build_conditioning, {"preset": config.preset, "weights": weights,
                                                      "config": config.conditioning, "seed": seed, "family": family,
                                                      "batcher": encode_batcher}, group),
            Node("diffusion", chunk_diffusion, {"config": config.diffusion, "stream": stream, "batcher": batcher,
                                                "token_shape": (cfg.latents_per_chunk, cfg.audio_tokens, cfg.dim)}, group),
            Node("decode", chunk_decode, {"config": config.decode, "stream": stream, "batcher": decode_batcher}, group)]


def build_graph(config: PipelineConfig, output: PlayoutOutput, tracer: TurnTracer | None = None,
                user_audio: UserAudioQueue | None = None, agent: AgentAdapter | None = None,
                weights: str | None = "packaged", link: PeerLink | None = None,
                batcher: StepBatcher | ChunkDenoiseBatcher | None = None,
                decode_batcher: DecodeBatcher | ChunkDecodeBatcher | None = None, family: ModelFamily | None = None,
                portrait: np.ndarray | None = None, encode_batcher: EncodeBatcher | None = None) -> Graph:
    """The session's stages and edges, each stage built from its config section. ``weights``: a
    weights file, ``"packaged"`` (the trained weights shipped for the preset, when present) or None
    (seeded random weights). The live objects — playout's ``output``, the ``tracer``, the user's
    microphone (``user_audio``; None: no microphone), a pushed ``agent`` adapter, the peer
    ``link`` (None: no browser, e.g. a framework reads ``output``), the process's step ``batcher``, its
    ``decode_batcher`` (then diffusion, or decode, runs in the caller's process too) and its
    ``encode_batcher`` (a chunk model's conditioning) — are handed to
    the nodes of the caller's process (group ``main``), never pickled."""
    from charstream.model.families import get_family

    family = family or get_family(config.preset)
    conditioning, diffusion, decode = model_nodes(config, weights, batcher, decode_batcher, family, portrait,
                                                  encode_batcher)
    nodes = [
        Node("ingest", IngestStage, {"config": config.ingest, "user_audio": user_audio, "adapter": agent,
                                     "tracer": tracer, "timeline": output.timeline}),
        conditioning,
        diffusion,
        decode,
        Node("playout", PlayoutStage, {"config": config.playout, "output": output, "tracer": tracer,
                                       "timeline": output.timeline,
                                       "rephase": family.generation_mode == "chunk_motion"}),
    ]
    edges = [
        Edge("ingest", "conditioning"),
        # One step in hand at each model stage: enough to overlap, little to throw away on rollback.
        Edge("conditioning", "diffusion", capacity=1),
        Edge("diffusion", "decode", capacity=1),
        Edge("decode", "playout", capacity=2),
    ]
    if link is not None:
        nodes.append(Node("egress", EgressStage, {"config": config.egress, "link": link}))
    return Graph(nodes, edges)


def testcard_graph(config: PipelineConfig, output: PlayoutOutput, tracer: TurnTracer | None = None,
                   user_audio: UserAudioQueue | None = None, link: PeerLink | None = None,
                   card: Node | None = None) -> Graph:
    """The test card's session: a ``CardSource`` (or ``card``, a node named "card" whose kwargs get
    ``user_audio``) in place of the model stages, then the same playout and egress nodes."""
    card = card or Node("card", CardSource, {"timeline": output.timeline})  # a given card brings its own
    card = Node("card", card.factory, {**card.kwargs, "user_audio": user_audio})
    nodes = [card, Node("playout", PlayoutStage, {"config": config.playout, "output": output, "tracer": tracer,
                                                  "timeline": output.timeline})]
    if link is not None:
        nodes.append(Node("egress", EgressStage, {"config": config.egress, "link": link}))
    return Graph(nodes, [Edge("card", "playout", capacity=2)])


class LiveSession:
    """A running session: its ``SessionRunner``, tracer, playout output and peer link.

    ``peer=False``: no browser (a framework reads ``output`` itself), so no egress node. ``testcard``:
    the test card's graph (True, or the card's ``Node``) instead of the model's. ``agent_hub``: the
    server's shared agent socket, which a ``zmq`` session's external agent joins (with the
    session's ``agent_token``) instead of binding one of its own. ``batcher`` / ``decode_batcher`` /
    ``encode_batcher``: the process's shared diffusion step, decode and encode batchers
    (``session_factory`` makes them when ``diffusion``, ``decode`` or ``conditioning.batch_sessions`` > 1)."""

    def __init__(self, config: PipelineConfig, session_id: str, weights: str | None = "packaged",
                 on_turn: Callable[[TurnRecord], None] | None = None, *, peer: bool = True,
                 testcard: bool | Node = False, agent_hub: AgentHub | None = None,
                 batcher: StepBatcher | ChunkDenoiseBatcher | None = None,
                 decode_batcher: DecodeBatcher | ChunkDecodeBatcher | None = None,
                 family: ModelFamily | None = None, portrait: np.ndarray | None = None,
                 encode_batcher: EncodeBatcher | None = None) -> None:
        self.config = config
        self.session_id = session_id
        self.tracer = TurnTracer(session_id, config.tracing, on_turn=on_turn)
        timeline = family.timeline if family is not None else config.timeline  # the session's clock
        self.output = PlayoutOutput(config.playout.history_frames, timeline=timeline)
        self.user_audio = UserAudioQueue(config.egress.user_audio_queue_frames)
        self.link = PeerLink() if peer else None
        self.push_adapter: PushAdapter | None = None
        self.agent_token: str | None = None
        if testcard:
            card = testcard if isinstance(testcard, Node) else None
            graph = testcard_graph(config, self.output, self.tracer, self.user_audio, self.link, card)
        else:
            mic = None if config.ingest.adapter == "scripted" else self.user_audio  # the scripted agent is its own user
            # Frameworks that own the conversation push into the session's adapter (EmbeddedSession).
            self.push_adapter = PushAdapter() if config.ingest.adapter in PUSH_ADAPTERS else None
            agent: AgentAdapter | None = self.push_adapter
            if agent_hub is not None and config.ingest.adapter == "zmq":
                agent = ExternalAgent(config.ingest, session_id, hub=agent_hub)
                self.agent_token = agent.token
            graph = build_graph(config, self.output, self.tracer, mic, agent, weights, self.link, batcher,
                                decode_batcher, family, portrait, encode_batcher)
        self.runner = SessionRunner(graph, config, session_id, handle_signals=False)
        self.result: SessionResult | None = None
        self.done = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def stages(self) -> dict[str, Stage]:
        """The stage objects running in this process (playout, ingest, ...), once built."""
        return self.runner.stages

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"session-{self.session_id}")

    async def _run(self) -> None:
        # The page hears why as soon as the end is decided: a frozen process's teardown takes seconds.
        tell = asyncio.create_task(self._tell_peer()) if self.link is not None else None
        try:
            self.result = await self.runner.run()
        finally:
            if tell is not None:
                if self.runner.ended_at is None:  # run() failed before any end was decided
                    tell.cancel()
                await asyncio.gather(tell, return_exceptions=True)
            result = self.result
            error = None if result is not None and result.ok else ((result and result.error) or "session failed")
            if self.link is not None:  # the page is told why its session ended, and its connection closed
                await self.link.end((result.error or result.ended_by) if result is not None else "the session failed")
            self.tracer.close(error=error)
            if result is not None:
                forget_processes(result.processes.values())  # their series end with the session
            self.output.close()
            self.user_audio.close()
            self.done.set()

    async def _tell_peer(self) -> None:
        result = await self.runner.wait_ending()
        await self.link.end(result.error or result.ended_by)

    async def stop(self, reason: str = "requested") -> SessionResult | None:
        """End the session and wait for it (idempotent)."""
        if self._task is None:
            return None
        self.runner.stop(reason)
        await self.done.wait()
        return self.result

    def media(self) -> SessionMedia:
        """What the egress server needs for this session's peer connection."""
        if self.link is None:
            raise RuntimeError("a session made with peer=False has no peer connection to serve")
        return SessionMedia(self.output, self.link, self.user_audio, on_turn=self.tracer.merge, close=self.stop)


def process_batchers(config: PipelineConfig, family: ModelFamily, weights: str | None) -> tuple[
        StepBatcher | ChunkDenoiseBatcher | None, DecodeBatcher | ChunkDecodeBatcher | None, EncodeBatcher | None]:
    """The batchers one process's sessions share (a serving process's, or a model engine's), as
    ``(diffusion, decode, encode)``, None where off: with ``diffusion.batch_sessions`` > 1 one model and
    their diffusion steps (``StepBatcher``), with ``decode.batch_sessions`` > 1 one decoder and their
    chunks (``DecodeBatcher``); a ``chunk_motion`` family's their chunks' denoising and decoding through
    shared runners (``stages/shared/chunk_batcher.py``) and, with ``conditioning.batch_sessions`` > 1,
    their audio encodes (``EncodeBatcher``). On CUDA the shared model is loaded and compiled first."""
    batch_steps, batch_decodes = config.diffusion.batch_sessions > 1, config.decode.batch_sessions > 1
    model_weights = None if weights in (None, "random") else weights  # a family's: None = seeded random
    device, seed = config.diffusion.device, config.diffusion.seed
    if device.startswith("cuda"):
        took = family.warm_up(model_weights, device, seed, batched=batch_steps or batch_decodes)
        if took:
            print(f"charstream: {config.preset} loaded and compiled on {device} in {took:.0f} s "
                  "(longer on a first run, before torch's compile cache holds it)", file=sys.stderr, flush=True)
    if family.generation_mode != "chunk_motion":
        return (StepBatcher(config.diffusion, config.preset, weights) if batch_steps else None,
                DecodeBatcher(config.decode, config.preset, weights, seed) if batch_decodes else None, None)

    def runner(graphed: bool) -> ChunkRunner:  # each batcher its own, on a CUDA stream of its own
        return family.chunk_runner(model_weights, device, seed, batched=True, graphed=graphed)

    encode_batcher = None
    if config.conditioning.batch_sessions > 1:  # the family's encoder, shared already
        conditioner = family.audio_conditioner(model_weights, config.conditioning.device, seed, config.conditioning.graphed)
        if conditioner.encode_batch is not None:
            encode_batcher = EncodeBatcher(config.conditioning, conditioner, family.timeline)
    return (ChunkDenoiseBatcher(config.diffusion, runner(config.diffusion.step.graphed)) if batch_steps else None,
            ChunkDecodeBatcher(config.decode, runner(config.decode.graphed)) if batch_decodes else None, encode_batcher)


def session_factory(config: PipelineConfig, weights: str | None = "packaged",
                    on_session: Callable[[LiveSession], Any] | None = None,
                    testcard: bool | Node = False, out_dir: Path | None = None,
                    agent_hub: AgentHub | None = None, portrait: np.ndarray | None = None,
                    family: ModelFamily | None = None) -> SessionFactory:
    """An egress ``SessionFactory``: each new peer gets its own ``LiveSession``. Its trace goes to
    ``out_dir/<session>/trace.jsonl`` when ``out_dir`` is given, else to the config's file (own
    name when several sessions share a config: ``<stem>-<session>.jsonl`` after the first).
    ``factory.sessions`` holds the running ones by session id. With ``diffusion.batch_sessions`` > 1
    its sessions share one model and batch their diffusion steps (``factory.batcher``); with
    ``decode.batch_sessions`` > 1 one decoder and their chunks (``factory.decode_batcher``); a
    ``chunk_motion`` family's sessions their chunks' denoising and decoding
    (``stages/shared/chunk_batcher.py``) and, with ``conditioning.batch_sessions`` > 1, their audio encodes
    (``factory.encode_batcher``, ``stages/conditioning/batcher.py``). Prepares
    the serving process (``pipeline/runtime/process.py``): its GIL switch interval
    (``config.gil_switch_interval_ms``: its sessions' threads share it), the imports of what its sessions
    run and the frozen heap (``config.freeze_heap``). ``portrait``: the face a portrait model (FlashHead)
    animates, each session encoding it once. ``family``: the sessions' model (default: the one
    ``config.preset`` names; another size of it, e.g. a CPU check)."""
    from charstream.model.families import get_family

    here = not testcard and config.hosting != "engine"  # the engine batches its sessions' model stages itself
    prepare_process("serving", config, ["ingest", *(MODEL_STAGES if here else ())])
    family = family or get_family(config.preset)
    batcher, decode_batcher, encode_batcher = process_batchers(config, family, weights) if here else (None, None, None)
    started = 0
    sessions: dict[str, LiveSession] = {}

    async def factory(session_id: str) -> SessionMedia:
        nonlocal started
        session_config = copy.deepcopy(config)
        path = session_config.tracing.jsonl_path
        if out_dir is not None:
            session_config.tracing.jsonl_path = str(out_dir / session_id / "trace.jsonl")
        elif path and started:
            stem, _, ext = path.rpartition(".")
            session_config.tracing.jsonl_path = f"{stem}-{session_id}.{ext}" if stem else f"{path}-{session_id}"
        started += 1
        session = LiveSession(session_config, session_id, weights, testcard=testcard, agent_hub=agent_hub,
                              batcher=batcher, decode_batcher=decode_batcher, portrait=portrait, family=family,
                              encode_batcher=encode_batcher)
        sessions[session_id] = session
        session.start()
        session._task.add_done_callback(lambda _: sessions.pop(session_id, None))
        if on_session is not None:
            on_session(session)
        return session.media()

    factory.sessions = sessions  # type: ignore[attr-defined]
    factory.batcher = batcher  # type: ignore[attr-defined]
    factory.decode_batcher = decode_batcher  # type: ignore[attr-defined]
    factory.encode_batcher = encode_batcher  # type: ignore[attr-defined]
    return factory
