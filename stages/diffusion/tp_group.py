"""The diffusion tensor-parallel group: one process per rank, rank 0 in the diffusion stage's process.

Rank 0 does all ZeroMQ I/O. Every rank runs the same ``model.step.DiffusionStep`` (on CUDA with a
bf16 model and an FP8 ring: the fused body as CUDA graphs, the all-reduces inside them; every rank
captures at the same broadcast reset, so the recorded collectives match). Every generator call
rank 0 makes (reset, step, rollback) is first broadcast to the other ranks as a small int64 header plus its tensor payload, so all ranks run the
same collectives in the same order; only rank 0's result is used. Workers are spawned processes
that die with rank 0 (PDEATHSIG), children of a ``transport.supervisor.Supervisor`` as stage processes
are; a worker that dies makes rank 0's next collective fail, which ends the session with an error naming
the diffusion stage (docs/ARCHITECTURE.md, Processes).

    group = TPGenerator(cfg, world=3, devices=["cuda:0", "cuda:1", "cuda:2"], weights=path)
    group.reset_session(reference_latent)
    latent = group.step(audio_tokens, seed)
    group.close()
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from charstream.model.config import ModelConfig
from charstream.model.generator import Generator
from charstream.model.step import StepOptions
from charstream.model.step.options import DEFAULTS
from charstream.transport.supervisor import Supervisor

_RESET, _STEP, _ROLLBACK, _STOP = range(4)
# Multicast over NVLink stays off: on shared multi-tenant hosts it can take GPUs down.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class RankSpec:
    cfg: ModelConfig
    world: int
    devices: tuple[str, ...]
    init_method: str
    weights: str | None
    fp8_cache: bool
    dtype: torch.dtype
    seed: int
    options: StepOptions


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _join(spec: RankSpec, rank: int) -> Generator:
    device = spec.devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    # A bounded timeout: a rank that vanished mid-collective fails the step instead of hanging it.
    dist.init_process_group(_backend(device), init_method=spec.init_method, rank=rank, world_size=spec.world,
                            timeout=timedelta(seconds=60))
    return Generator(spec.cfg, spec.weights, device, dist.group.WORLD, spec.dtype, spec.fp8_cache, seed=spec.seed,
                     options=spec.options)


def _worker(rank: int, spec: RankSpec) -> dict:
    """Rank ``rank`` (a ``Supervisor`` target, which dies with its parent): runs what rank 0 broadcasts."""
    torch.set_num_threads(1)
    gen = _join(spec, rank)
    device = torch.device(spec.devices[rank])
    cfg = spec.cfg
    header = torch.zeros(2, dtype=torch.int64, device=device)
    try:
        while True:
            dist.broadcast(header, src=0)
            op, arg = header.tolist()
            if op == _RESET:
                ref = torch.empty(cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=device)
                dist.broadcast(ref, src=0)
                gen.reset_session(ref)
            elif op == _STEP:
                audio = torch.empty(cfg.n_audio_tokens, cfg.audio_dim, device=device)
                dist.broadcast(audio, src=0)
                gen.step(audio, seed=arg)
            elif op == _ROLLBACK:
                gen.rollback(arg)
            else:
                break
    finally:
        dist.destroy_process_group()
    return {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGenerator:
    """Rank 0 of a TP group with the ``Generator`` API; spawns and drives ranks 1..world-1."""

    def __init__(
        self,
        cfg: ModelConfig,
        world: int,
        devices: list[str] | None = None,
        weights: str | Path | None = None,
        fp8_cache: bool = True,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        options: StepOptions = DEFAULTS,
    ) -> None:
        """``options``: every rank's step's, as ``Generator`` takes them."""
        cfg.validate(world)
        devices = devices or ["cpu"] * world
        if len(devices) != world:
            raise ValueError(f"TP world {world} needs {world} devices, got {devices}")
        os.environ.update(NO_MULTICAST)
        self.spec = RankSpec(cfg, world, tuple(devices), f"tcp://127.0.0.1:{_free_port()}",
                             str(weights) if weights else None, fp8_cache, dtype, seed, options)
        self.supervisor = Supervisor()
        self.workers = [self.supervisor.launch(f"diffusion-tp{r}", _worker, r, self.spec, daemon=True)
                        for r in range(1, world)]
        self.generator = _join(self.spec, 0)
        self.device = torch.device(devices[0])
        self._header = torch.zeros(2, dtype=torch.int64, device=self.device)

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.cfg

    @property
    def next_frame(self) -> int:
        return self.generator.next_frame

    def _send(self, op: int, arg: int = 0, payload: torch.Tensor | None = None) -> None:
        dead = [c.name for c in self.workers if not c.process.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank process(es) died: {', '.join(dead)}")
        self._header.copy_(torch.tensor([op, arg]))
        dist.broadcast(self._header, src=0)
        if payload is not None:
            dist.broadcast(payload.to(self.device, torch.float32).contiguous(), src=0)

    def reset_session(self, reference_latent: torch.Tensor) -> None:
        self._send(_RESET, payload=reference_latent)
        self.generator.reset_session(reference_latent)

    def step(self, audio_tokens: torch.Tensor, seed: int) -> torch.Tensor:
        self._send(_STEP, seed, payload=audio_tokens)
        return self.generator.step(audio_tokens, seed)

    def rollback(self, k: int) -> int:
        self._send(_ROLLBACK, k)
        return self.generator.rollback(k)

    def close(self) -> None:
        """Stop the workers and leave the group; idempotent."""
        if not dist.is_initialized():
            return
        if all(c.process.is_alive() for c in self.workers):
            self._send(_STOP)
        dist.destroy_process_group()
        for child in self.workers:
            child.process.join(timeout=5)
            self.supervisor.kill(child)  # if it is still running; reaps it either way
