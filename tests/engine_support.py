"""A ``charstream engine`` process for tests: started, answering, stopped; and the frames a session releases."""

from __future__ import annotations

import asyncio
import ctypes
import signal
import subprocess
import sys
import time

from charstream.pipeline.runtime.engine_link import EngineError, engine_call
from charstream.pipeline.session import LiveSession
from charstream.transport.supervisor import PR_SET_PDEATHSIG

DETECT_S = 2.0


def launch_engine(endpoint: str, log_path, *args: str) -> subprocess.Popen:
    """``charstream engine`` on ``endpoint``, started; it dies with the calling thread (PR_SET_PDEATHSIG)."""
    log = open(log_path, "w")  # noqa: SIM115 -- the process writes it until the test ends
    return subprocess.Popen([sys.executable, "-m", "charstream", "engine", "--bind", endpoint, *args],
                            stdout=log, stderr=log, preexec_fn=die_with_the_test)


async def answering(endpoint: str, proc: subprocess.Popen, log_path) -> None:
    """Until the engine answers status (its torch imported, its socket bound); killed if it never does."""
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                await engine_call(endpoint, {"cmd": "status"}, timeout=1.0)
                return
            except EngineError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine did not start: {open(log_path).read()[-2000:]}") from None
    except BaseException:
        proc.kill()  # never left behind
        proc.wait()
        raise


def start_engine(endpoint: str, log_path, *args: str) -> subprocess.Popen:
    """``charstream engine`` on ``endpoint``, answering status."""
    proc = launch_engine(endpoint, log_path, *args)
    asyncio.run(answering(endpoint, proc, log_path))
    return proc


def stop_engine(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def die_with_the_test() -> None:
    """(in the engine's process, before exec) SIGKILL when the test process dies: a killed run leaves no engine."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


async def frames_released(session: LiveSession, count: int) -> dict:
    """The first ``count`` generated frames (not the held start frame) the session's playout releases,
    by (chunk, frame in chunk)."""
    out, index, frames = session.output, 0, {}
    await out.wait_started()
    while len(frames) < count:
        frame = await out.frame_at(index)
        index = frame.index + 1
        if frame.chunk is not None:
            frames[(frame.chunk, frame.frame_in_chunk)] = frame.image
    return frames
