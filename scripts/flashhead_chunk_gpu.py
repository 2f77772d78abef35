"""Lab script (not shipped): a whole FlashHead Pro chunk, ours beside the model's own code, in one process.

Both load one released-layout folder written here with seeded random weights of the real Pro config
(``Model_Pro`` sharded safetensors in the checkpoint's names, ``VAE_Wan/Wan2.1_VAE.pth``, a wav2vec2-base
folder): ours through its loader, theirs through its ``from_pretrained``. A chunk, each side as it streams:
the 8 s audio window encoded (wav2vec2 + adapter), 4 DiT passes, the VAE decode of 33 frames, the colour
match and re-encode of the last 5 frames, the 28 new frames to the host. Theirs: its streaming loop
(``generate_video.py --audio_encode_mode stream``) with its ``torch.compile`` switches on; ours: the
objects the stages call (``charstream bench chunk``'s ``Session``). The two alternate chunk by chunk after
their warm-up chunks. Prints a table, writes ``flashhead_chunk_gpu.json``.

    python scripts/flashhead_chunk_gpu.py --theirs DIR --out DIR [--chunks 10]

DIR for --theirs is a snapshot of the model's repository (its ``flash_head/`` package), with stand-ins for
the modules it imports only for multi-GPU runs or face cropping (``xfuser``, ``mediapipe``, ``pyloudnorm``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from collections import deque
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from flashhead_support import model_config_json, write_sharded, write_wav2vec2  # noqa: E402
from test_flashhead_vae_wan import random_wan_state  # noqa: E402

from charstream.model.families import get_family  # noqa: E402
from charstream.model.families.flashhead.config import PRO  # noqa: E402
from charstream.model.families.flashhead.loader import random_checkpoint  # noqa: E402
from charstream.pipeline.bench.chunk import Session  # noqa: E402


def write_release(root: Path, seed: int) -> None:
    """The released layout with seeded random weights (bf16 DiT, fp32 VAE and wav2vec2)."""
    model = root / "Model_Pro"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(model_config_json(PRO)))
    state = {k: v.to(torch.bfloat16).cpu() for k, v in random_checkpoint(PRO, seed, "cuda").items()}
    write_sharded(model, state)
    (root / "VAE_Wan").mkdir()
    torch.save(random_wan_state(seed), root / "VAE_Wan" / "Wan2.1_VAE.pth")
    write_wav2vec2(root / "wav2vec2-base-960h", seed)


class HiddenStates(torch.nn.Module):
    """The model's wav2vec2 subclass under transformers 5, which collects hidden states through hooks of the
    library's own forward, not the subclass's: the same forward, its layers' outputs gathered by hooks."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.inner = encoder
        self.outputs: list[torch.Tensor] = []
        for layer in encoder.encoder.layers:
            layer.register_forward_hook(lambda _m, _i, out: self.outputs.append(out[0] if isinstance(out, tuple) else out))

    def forward(self, *args, **kwargs):
        self.outputs.clear()
        result = self.inner(*args, **kwargs)
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=result.last_hidden_state, hidden_states=(result.last_hidden_state, *self.outputs))


class Theirs:
    """The released streaming loop, one chunk per call."""

    def __init__(self, snapshot: Path, release: Path, portrait: Path) -> None:
        for name in ("mediapipe", "pyloudnorm"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.path.insert(0, str(snapshot))
        here = os.getcwd()
        os.chdir(snapshot)  # its inference module reads flash_head/configs/infer_params.yaml from here
        try:
            from flash_head import inference
        finally:
            os.chdir(here)
        self.inference = inference
        self.pipeline = inference.get_pipeline(1, str(release), "pro", str(release / "wav2vec2-base-960h"))
        self.pipeline.audio_encoder = HiddenStates(self.pipeline.audio_encoder)
        inference.get_base_data(self.pipeline, str(portrait), 42, False)
        p = inference.get_infer_params()
        self.motion_frames = p["motion_frames_num"]
        self.hop = (p["frame_num"] - self.motion_frames) * p["sample_rate"] // p["tgt_fps"]
        self.end = p["cached_audio_duration"] * p["tgt_fps"]
        self.start = self.end - p["frame_num"]
        self.audio = deque([0.0] * (p["sample_rate"] * p["cached_audio_duration"]),
                           maxlen=p["sample_rate"] * p["cached_audio_duration"])
        self.rng = np.random.default_rng(1)

    def run_chunk(self) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        self.audio.extend((self.rng.standard_normal(self.hop) * 0.1).tolist())
        embedding = self.inference.get_audio_embedding(self.pipeline, np.array(self.audio), self.start, self.end)
        video = self.inference.run_pipeline(self.pipeline, embedding)[self.motion_frames:]
        frames = video.cpu()
        torch.cuda.synchronize()
        assert frames.shape[0] == 28
        return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--theirs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--skip-theirs", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "chunks": args.chunks}

    def save() -> None:
        (out / "flashhead_chunk_gpu.json").write_text(json.dumps(results, indent=2))

    began = time.perf_counter()
    release = Path("/tmp/flashhead-release")
    if not release.exists():
        write_release(release, args.seed)
    results["write_release_s"] = time.perf_counter() - began
    portrait = release / "portrait.png"
    from PIL import Image

    Image.fromarray(np.random.default_rng(2).integers(0, 256, (512, 512, 3), dtype=np.uint8)).save(portrait)

    theirs = None
    if not args.skip_theirs:
        t = time.perf_counter()
        theirs = Theirs(Path(args.theirs).resolve(), release, portrait)
        for _ in range(args.warmup):
            theirs.run_chunk()
        results["theirs_load_and_compile_s"] = time.perf_counter() - t
        print(f"theirs ready in {results['theirs_load_and_compile_s']:.0f} s", flush=True)

    sync = torch.cuda.synchronize
    t = time.perf_counter()
    ours = Session(get_family("flashhead-pro"), str(release), "cuda", 0, None)
    for _ in range(args.warmup):
        ours.run_chunk(sync)
    results["ours_load_and_compile_s"] = time.perf_counter() - t
    print(f"ours ready in {results['ours_load_and_compile_s']:.0f} s", flush=True)

    mine, others = [], []
    for _ in range(args.chunks):
        if theirs is not None:
            others.append(theirs.run_chunk())
        mine.append(ours.run_chunk(sync))
    row = {f"ours_{part}_ms": 1e3 * statistics.median(r[part] for r in mine) for part in mine[0]}
    if others:
        row["theirs_chunk_ms"] = 1e3 * statistics.median(others)
        row["speedup"] = row["theirs_chunk_ms"] / row["ours_chunk_ms"]
    results |= row | {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    save()
    print("ours chunk ms  (encode / denoise / decode)  theirs chunk ms  speedup")
    print(f"{row['ours_chunk_ms']:>13.1f}  ({row['ours_encode_ms']:.1f} / {row['ours_denoise_ms']:.1f} / "
          f"{row['ours_decode_ms']:.1f})  {row.get('theirs_chunk_ms', float('nan')):>15.1f}  {row.get('speedup', float('nan')):.2f}")

if __name__ == "__main__":
    main()
