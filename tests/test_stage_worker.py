"""A stage's torch work on one long-lived thread of its own (stages/shared/worker.py), for each model stage."""

from __future__ import annotations

import threading
import time

import anyio
import numpy as np
import pytest
import structlog
import torch
from decode_support import latents_message

from charstream.model.config import TINY
from charstream.stages.base import StageContext
from charstream.stages.conditioning.stage import ConditioningStage
from charstream.stages.config import ConditioningConfig, DecodeConfig, DiffusionConfig
from charstream.stages.decode.stage import DecodeStage
from charstream.stages.diffusion.stage import DiffusionStage
from charstream.stages.shared.worker import StageWorker
from charstream.timeline import CHARACTERS
from charstream.transport.messages import Conditioning, Control, ControlKind


def _context(stage: str) -> StageContext:
    async def emit(msg) -> None:
        pass

    async def send_control(msg) -> None:
        pass

    return StageContext(stage, "s1", emit, send_control, structlog.get_logger())


class Seen:
    """Wraps a stage's work function: the thread and torch intra-op threads of every call."""

    def __init__(self, fn):
        self.fn, self.threads, self.intra_op = fn, [], []

    def __call__(self, *args):
        self.threads.append(threading.current_thread())
        self.intra_op.append(torch.get_num_threads())
        return self.fn(*args)

    def assert_one_thread(self, calls: int, intra_op: int) -> threading.Thread:
        assert len(self.threads) >= calls and len(set(self.threads)) == 1
        assert self.threads[0] is not threading.current_thread()  # off the event loop
        assert set(self.intra_op) == {intra_op}
        return self.threads[0]


def assert_ended(thread: threading.Thread) -> None:
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_calls_run_on_one_thread_with_its_intra_op_threads_and_close_ends_it():
    async def main():
        worker = StageWorker("test", threads=1)
        seen = Seen(lambda: None)
        for _ in range(5):
            await worker.run(seen)
            await anyio.sleep(0.01)
        worker.close()
        with pytest.raises(RuntimeError, match="the test worker is closed"):
            await worker.run(seen)
        return seen

    seen = anyio.run(main)
    assert seen.assert_one_thread(5, 1).name.startswith("test")
    assert_ended(seen.threads[0])


def test_an_exception_in_the_work_reaches_the_caller_and_the_worker_goes_on():
    def fails(x: int) -> int:
        raise ValueError(f"bad input {x}")

    async def main():
        worker = StageWorker("test")
        with pytest.raises(ValueError, match="bad input 3"):
            await worker.run(fails, 3)
        result = await worker.run(lambda a, b: (a + b, threading.current_thread()), 2, 3)
        worker.close()
        return result

    total, thread = anyio.run(main)
    assert total == 5
    assert_ended(thread)


def test_callers_take_turns_and_a_cancelled_caller_waits_for_its_work():
    log: list[tuple[str, int]] = []

    def work(i: int) -> None:
        log.append(("start", i))
        time.sleep(0.05)
        log.append(("end", i))

    async def main():
        worker = StageWorker("test")
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(worker.run, work, i)
                await anyio.sleep(0)  # arrival order
        assert log == [(k, i) for i in range(3) for k in ("start", "end")]  # one at a time, in order
        log.clear()
        with anyio.move_on_after(0.01):
            await worker.run(work, 9)
        assert log == [("start", 9), ("end", 9)]  # cancelled, but only after its work finished
        worker.close()

    anyio.run(main)


def test_a_worker_refuses_a_bad_thread_count_or_a_stream_off_cuda():
    with pytest.raises(ValueError, match="intra-op threads must be >= 1, got 0"):
        StageWorker("decode", threads=0)
    with pytest.raises(ValueError, match="a stream needs a CUDA device, not 'cpu'"):
        StageWorker("decode", cuda_stream="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_worker_queues_its_work_on_a_stream_of_its_own_after_what_was_queued_before():
    """Two workers of one process (two sessions' stages in an engine): each thread's current stream is
    its own, not the default one, and the first call sees what the default stream wrote before it."""
    def on_stream(x: torch.Tensor) -> tuple[int, float]:
        stream = torch.cuda.current_stream()
        return stream.cuda_stream, float((x @ x).sum().cpu())

    async def main():
        x = torch.randn(4096, 4096, device="cuda")  # queued on the default stream, maybe still running
        x.mul_(0).add_(1.0)
        first, second = StageWorker("a", cuda_stream="cuda:0"), StageWorker("b", cuda_stream="cuda:0")
        (a, got_a), (b, got_b) = await first.run(on_stream, x), await second.run(on_stream, x)
        assert torch.cuda.current_stream().cuda_stream == torch.cuda.default_stream().cuda_stream
        assert len({a, b, torch.cuda.default_stream().cuda_stream}) == 3
        assert got_a == got_b == 4096.0 ** 3  # all ones: exact in float32
        assert (await first.run(on_stream, x))[0] == a  # the thread keeps its stream
        first.close()
        second.close()

    anyio.run(main)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_urgent_worker_stream_has_the_devices_highest_priority():
    """Conditioning's encodes go ahead of the chunks' kernels: its stream has the highest priority the
    device offers, an ordinary worker's the default."""
    async def main():
        urgent, plain = StageWorker("u", cuda_stream="cuda:0", urgent=True), StageWorker("p", cuda_stream="cuda:0")
        highest = torch.cuda.Stream(priority=-1000).priority  # clamped to the device's range
        assert highest < 0
        assert await urgent.run(lambda: torch.cuda.current_stream().priority) == highest
        assert await plain.run(lambda: torch.cuda.current_stream().priority) == 0
        urgent.close()
        plain.close()

    anyio.run(main)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_workers_start_while_another_thread_captures_a_graph():
    """An engine builds a session's stages while another session captures its graphs: a worker's start
    (its stream ordered after the default stream) must not touch the capture (model/graphs.py's
    thread-local mode; a device-wide synchronize here invalidated it)."""
    from charstream.model.graphs import CAPTURE_MODE

    x = torch.randn(256, 256, device="cuda")
    capturing, started, errors = threading.Event(), threading.Event(), []

    def capture() -> None:
        try:
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            with torch.cuda.stream(stream):
                y = x @ x
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph, stream=stream, capture_error_mode=CAPTURE_MODE):
                capturing.set()
                for _ in range(20_000):  # until the workers have started (bounded)
                    y = y @ x * 1e-3
                    if started.is_set():
                        break
            graph.replay()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            errors.append(e)
            capturing.set()

    async def main():
        thread = threading.Thread(target=capture)
        thread.start()
        assert capturing.wait(30)
        workers = [StageWorker(f"w{i}", cuda_stream="cuda:0") for i in range(3)]
        sums = [await w.run(lambda: float((x @ x).sum().cpu())) for w in workers]
        started.set()
        thread.join(30)
        assert not errors, errors
        assert len(set(sums)) == 1
        for w in workers:
            w.close()

    anyio.run(main)


def test_each_model_stage_keeps_its_work_on_one_thread_of_its_own_and_teardown_ends_it():
    """Diffusion, decode and conditioning side by side, as in a session: each stage's calls on one
    thread, three different threads, each with its intra-op count, each ended by its teardown."""
    tokens = np.zeros((TINY.n_audio_tokens, TINY.audio_dim), np.float32)
    encodes = Seen(lambda window: tokens)

    def conditioning(chunk: int, epoch: int) -> Conditioning:
        audio = np.random.default_rng(chunk).standard_normal((TINY.n_audio_tokens, TINY.audio_dim)).astype(np.float32)
        return Conditioning("s1", chunk, audio, np.zeros(CHARACTERS.samples_per_chunk, np.int16), False, epoch)

    async def diffuse(stage: DiffusionStage) -> None:
        ctx = _context("diffusion")
        await stage.setup(ctx)
        for chunk in range(6):
            await stage.process(conditioning(chunk, 0), ctx)
        await stage.control(Control("s1", 0, ControlKind.ROLLBACK, chunk=2, epoch=1), ctx)
        await stage.process(conditioning(3, 1), ctx)

    async def decode(stage: DecodeStage) -> None:
        ctx = _context("decode")
        await stage.setup(ctx)  # the warm-up decode
        for chunk in range(6):
            await stage.process(latents_message("s1", chunk, 0), ctx)

    async def encode(stage: ConditioningStage) -> None:
        send, receive = anyio.create_memory_object_stream(1)
        ctx = StageContext("conditioning", "s1", send.send, _context("x").send_control, structlog.get_logger())
        await stage.setup(ctx)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stage.run, ctx)
            for _ in range(3):  # listening chunks: silence encoded twice at the start, then reused
                await receive.receive()
            tg.cancel_scope.cancel()

    async def main():
        diffusion = DiffusionStage(DiffusionConfig(seed=7, fp8_cache=False, threads=1), "tiny", weights=None)
        decoder = DecodeStage(DecodeConfig(threads=2), "tiny", weights=None, seed=7)
        encoder = ConditioningStage(ConditioningConfig(idle_lead_chunks=None), encodes, 40.0, 80.0)
        diffusion._step, diffusion._rewind_to = steps, rewinds = Seen(diffusion._step), Seen(diffusion._rewind_to)
        decoder._decode = decodes = Seen(decoder._decode)
        async with anyio.create_task_group() as tg:
            tg.start_soon(diffuse, diffusion)
            tg.start_soon(decode, decoder)
            tg.start_soon(encode, encoder)
        assert diffusion.stats.generated == 7 and diffusion.stats.frames_rolled_back == 3
        assert decoder.stats.decoded == 6
        threads = [steps.assert_one_thread(7, 1), decodes.assert_one_thread(7, 2), encodes.assert_one_thread(2, 1)]
        assert rewinds.assert_one_thread(1, 1) is threads[0]
        assert len(set(threads)) == 3
        for stage in (diffusion, decoder, encoder):
            await stage.teardown()
        for thread in threads:  # ended by the teardowns, while the event loop (and anyio's workers) still run
            assert_ended(thread)

    anyio.run(main)
