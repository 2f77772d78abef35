"""FlashHead's model side on the CPU: our DiT and audio path against the libraries the released model is
built on (diffusers' Wan transformer, transformers' wav2vec2), fed the same seeded random weights
written in the released checkpoint's names and layout; the sampler; the loader's refusals."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from charstream.model.families import get_family
from charstream.model.families.base import CheckpointError
from charstream.model.families.flashhead.audio import RollingSpeech, frame_windows
from charstream.model.families.flashhead.config import LITE, PRO, TEST
from charstream.model.families.flashhead.dit import round_to_bf16
from charstream.model.families.flashhead.loader import load_flashhead, random_checkpoint
from charstream.model.families.flashhead.sampler import sample_chunk
from charstream.pipeline.cli import main
from tests.flashhead_support import (
    checkpoint_specs,
    model_config_json,
    write_extras,
    write_header_only,
    write_header_only_folder,
    write_sharded,
    write_wav2vec2,
)

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def wav2vec2_dir(tmp_path_factory):
    return write_wav2vec2(tmp_path_factory.mktemp("wav2vec2-base-960h"), seed=3)


@pytest.fixture(scope="module")
def released(tmp_path_factory, wav2vec2_dir):
    """A released-layout folder at the test size (2 blocks, real width), sharded, with random weights."""
    root = tmp_path_factory.mktemp("SoulX-FlashHead-1_3B")
    folder = root / "Model_Pro"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_config_json(TEST)))
    write_sharded(folder, random_checkpoint(TEST, seed=11))
    write_extras(root, TEST, wav2vec2=wav2vec2_dir)
    return root


@pytest.fixture(scope="module")
def ours(released):
    return load_flashhead(released, "pro")


def wan_forward_per_frame(model, noisy, reference, timestep, audio):
    """diffusers' WanTransformer3DModel run block by block, its cross-attention per latent frame."""
    x = torch.cat([noisy, reference], dim=1)
    rotary = model.rope(x)
    h = model.patch_embedding(x)
    batch, _, frames, rows, cols = h.shape
    h = h.flatten(2).transpose(1, 2)
    embedder = model.condition_embedder
    temb = embedder.time_embedder(embedder.timesteps_proj(timestep).to(h.dtype))
    time_proj = embedder.time_proj(embedder.act_fn(temb)).unflatten(1, (6, -1))
    for block in model.blocks:
        shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + time_proj).chunk(6, dim=1)
        h = h + block.attn1(block.norm1(h) * (1 + scale) + shift, None, None, rotary) * gate
        per_frame = block.norm2(h).reshape(batch * frames, -1, h.shape[-1])
        h = h + block.attn2(per_frame, audio.flatten(0, 1), None, None).reshape(h.shape)
        h = h + block.ffn(block.norm3(h) * (1 + c_scale) + c_shift) * c_gate
    shift, scale = (model.scale_shift_table + temb[:, None]).chunk(2, dim=1)
    h = model.proj_out(model.norm_out(h) * (1 + scale) + shift)
    h = h.reshape(batch, frames, rows, cols, 1, 2, 2, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return h.flatten(6, 7).flatten(4, 5).flatten(2, 3)


@torch.no_grad()
def test_dit_matches_diffusers_wan(released, ours):
    """The released files through diffusers' own Wan key converter load with nothing missing or left over
    (the audio adapter aside), and its modules give our DiT's output within 1e-4 at fp32."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    state = {}
    for shard in sorted((released / "Model_Pro").glob("*.safetensors")):
        state |= load_file(shard)
    wan_state = {k: v for k, v in state.items() if not k.startswith(("audio_proj.", "audio_emb."))}
    with torch.device("meta"):  # built empty, then given the file's tensors
        wan = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=32, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=TEST.n_blocks, cross_attn_norm=True, eps=1e-6,
        ).eval()  # fmt: skip
    converted = convert_wan_transformer_to_diffusers(wan_state)
    missing, unexpected = wan.load_state_dict(converted, strict=False, assign=True)
    assert (missing, unexpected) == ([], [])
    wan.rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024)  # its tables: buffers made at construction, not weights

    g = torch.Generator().manual_seed(5)
    frames, grid = 3, (4, 6)  # 3 latents of 2 x 3 tokens: the per-frame attention and RoPE axes all matter
    noisy = torch.randn(1, 16, frames, *grid, generator=g)
    reference = torch.randn(1, 16, frames, *grid, generator=g)
    audio = torch.randn(1, frames, TEST.audio_tokens, TEST.dim, generator=g)
    for sampler_step, seen in ((1000.0, 1000.0), (937.5, 936.0), (833.3333, 832.0), (625.0, 624.0)):
        expected = wan_forward_per_frame(wan, noisy, reference, torch.tensor([seen]), audio)
        got = ours.dit(noisy, reference, torch.tensor([sampler_step]), audio)
        assert got.shape == noisy.shape
        assert relative(got, expected) <= 1e-4, sampler_step
    # the frames' audio is their own: another frame's tokens change that frame's output only
    moved = audio.clone()
    moved[:, 1] = torch.randn(TEST.audio_tokens, TEST.dim, generator=g)
    delta = (ours.dit(noisy, reference, torch.tensor([1000.0]), moved) - ours.dit(noisy, reference, torch.tensor([1000.0]), audio)).abs()
    assert delta[:, :, 1].max() > 1e-3
    assert delta[:, :, 0].max() > 0 and delta[:, :, 2].max() > 0  # through self-attention, next block


@torch.no_grad()
def test_speech_features_match_transformers_wav2vec2(ours, wav2vec2_dir):
    """Our wav2vec2 path equals transformers' full Wav2Vec2Model forward (its feature extractor's
    normalisation, its hidden states) with the conv features interpolated to the frame count."""
    g = torch.Generator().manual_seed(8)
    speech = torch.randn(24000, generator=g) * torch.linspace(0.1, 1.0, 24000)  # 1.5 s, uneven loudness
    n_frames = 37  # 1.5 s x 25 fps, rounded down, as the released pipeline does
    extractor = transformers.Wav2Vec2FeatureExtractor(do_normalize=True, sampling_rate=16000)
    values = torch.from_numpy(extractor(speech.numpy(), sampling_rate=16000).input_values[0])[None]
    reference = transformers.Wav2Vec2Model.from_pretrained(wav2vec2_dir, local_files_only=True).eval()
    resample = reference.feature_extractor.register_forward_hook(
        lambda module, inputs, out: torch.nn.functional.interpolate(out, size=n_frames, mode="linear", align_corners=True)
    )
    expected = torch.stack(reference(values, output_hidden_states=True).hidden_states[1:], dim=2)[0]
    resample.remove()
    got = ours.speech(speech, n_frames)
    assert got.shape == (n_frames, 12, 768)
    assert relative(got, expected) <= 1e-4


@torch.no_grad()
def test_rolling_speech_encodes_the_last_seconds(ours):
    """Each chunk pushes 28 frames of speech (17,920 samples) into a context that starts silent and keeps
    its last seconds (8 released; 2 here, so the second chunk pushes the first partly out); the chunk's
    windows are the context's newest 33 frames, encoded together."""
    rolling = RollingSpeech(PRO.with_(audio_context_s=2))
    with pytest.raises(ValueError, match="a chunk is 17920 samples of speech, got 16000"):
        rolling.push(torch.zeros(16000))
    g = torch.Generator().manual_seed(6)
    chunks = [torch.randn(17920, generator=g) for _ in range(2)]
    for chunk in chunks:
        rolling.push(chunk)
    context = torch.cat(chunks)[-32000:]
    expected = frame_windows(ours.speech(context, 50), 50 - 33, 50, window=5)[None]
    assert torch.equal(rolling.windows(ours.speech), expected)


@torch.no_grad()
def test_adapter_reads_each_latent_its_frames(ours):
    """Latent 0 reads frame 0's 5-frame window; latent j reads its 4 frames 4j-3 .. 4j: the first frame's
    window up to itself, the middle two alone, the last from itself on -- each window clamped to the chunk."""
    g = torch.Generator().manual_seed(4)
    features = torch.randn(33, 12, 768, generator=g)
    windows = frame_windows(features, 0, 33, window=5)
    assert torch.equal(windows[0, 0], features[0]) and torch.equal(windows[32, 4], features[32])  # clamped
    adapter = ours.adapter
    got = adapter(windows[None])[0]
    assert got.shape == (9, 32, 1536)
    clamp = lambda i: min(max(i, 0), 32)  # noqa: E731
    inputs = [torch.stack([features[clamp(i)] for i in range(-2, 3)])]
    for j in range(1, 9):
        first, last = 4 * j - 3, 4 * j
        frames = [first - 2, first - 1, first, first + 1, first + 2, last, last + 1, last + 2]
        inputs.append(torch.stack([features[clamp(i)] for i in frames]))
    for j, x in enumerate(inputs):
        linear = adapter.first_in if j == 0 else adapter.grouped_in
        h = torch.relu(adapter.hidden(torch.relu(linear(x.flatten()))))
        tokens = adapter.norm(adapter.tokens_out(h).view(32, 1536))
        assert relative(got[j], tokens) <= 1e-5, j


@torch.no_grad()
def test_sampler_renoises_and_pins_motion(ours):
    """Each pass: motion latents written, x0 = x - sigma v, x = (1 - sigma') x0 + sigma' eps; the result
    ends with the motion latents in place."""
    g = torch.Generator().manual_seed(2)
    reference = torch.randn(1, 16, 3, 4, 4, generator=g)
    audio = torch.randn(1, 3, 32, 1536, generator=g)
    motion = torch.randn(1, 16, 2, 4, 4, generator=g)
    seen, passes = [], []
    hook = ours.dit.register_forward_pre_hook(lambda module, args: seen.append(args[0][:, :, :2].clone()))
    out = sample_chunk(ours.dit, reference, audio, motion, torch.Generator().manual_seed(9), lambda i, x: passes.append(x.clone()))
    hook.remove()
    assert len(seen) == 4 and all(torch.equal(s, motion) for s in seen)
    assert torch.equal(out[:, :, :2], motion) and torch.equal(out[:, :, 2:], passes[-1][:, :, 2:])
    # the first two passes by the formula, from the same noise stream
    stream = torch.Generator().manual_seed(9)
    x = torch.randn(reference.shape, generator=stream)
    for i, (sigma, sigma_next) in enumerate(((1.0, 0.9375), (0.9375, 5 / 6))):
        x[:, :, :2] = motion
        clean = x - sigma * ours.dit(x, reference, torch.tensor([sigma * 1000]), audio)
        x = (1 - sigma_next) * clean + sigma_next * torch.randn(reference.shape, generator=stream)
        assert relative(passes[i], x) <= 1e-5, i


def test_timestep_seen_in_bf16(ours):
    """The model sees the sampler's timesteps rounded to bf16, as the released bf16 model did."""
    emb = lambda t: ours.dit.time_embedding(torch.tensor([t]))[0]  # noqa: E731
    with torch.no_grad():
        assert torch.equal(emb(937.5), emb(936.0)) and torch.equal(emb(833.3333), emb(832.0))
        assert not torch.equal(emb(936.0), emb(940.0))


def test_real_sizes_inspected_without_allocation(tmp_path):
    """Full-size Pro and Lite folders (header-only, 6 GB each as sparse files): the tensor count and
    parameter count of the released Pro files (843, 1,507,694,912 stored), each variant told from its weights."""
    pro = get_family("flashhead-pro").inspect(write_header_only_folder(tmp_path / "pro", PRO).parent)
    assert pro.ok and pro.variant == "pro" and pro.tensors == 843
    assert pro.stored_params == 1_507_694_912 and pro.params == get_family("flashhead-pro").parameter_count()
    assert len(pro.ignored) == 12  # text_embedding.*, audio_emb.*
    lite = get_family("flashhead-lite").inspect(write_header_only_folder(tmp_path / "lite", LITE).parent)
    assert lite.ok and lite.variant == "lite" and lite.params > pro.params
    write_header_only_folder(tmp_path / "renamed", LITE, model_dir="Model_Pro")
    with pytest.raises(CheckpointError, match="Model_Pro: holds FlashHead Lite weights, not Pro"):
        get_family("flashhead-pro").inspect(tmp_path / "renamed")


def test_refuses_missing_and_truncated_files(tmp_path, released):
    root = tmp_path / "copy"
    shutil.copytree(released, root, copy_function=os.link, symlinks=True)
    index = json.loads((root / "Model_Pro" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = root / "Model_Pro" / index["weight_map"]["head.head.weight"]
    data = shard.read_bytes()
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing"):
        load_flashhead(root, "pro")
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated: {len(data) - 100} bytes, its header describes {len(data)}"):
        load_flashhead(root, "pro")
    shard.write_bytes(data)
    vae = root / "VAE_Wan" / "Wan2.1_VAE.pth"
    vae.write_bytes(vae.read_bytes()[:-50])
    with pytest.raises(CheckpointError, match="Wan2.1_VAE.pth: unreadable"):
        load_flashhead(root, "pro")
    vae.unlink()
    with pytest.raises(CheckpointError, match="Wan2.1_VAE.pth: missing"):
        load_flashhead(root, "pro")


@pytest.mark.parametrize(
    ("name", "spec", "found"),
    [
        ("head.head.weight", ((64, 1024), "F32"), "head.head.weight: [64, 1024] in diffusion_pytorch_model.safetensors, the model needs [64, 1536]"),
        ("blocks.1.ffn.0.weight", ((8960, 1536), "I32"), "blocks.1.ffn.0.weight: I32 in diffusion_pytorch_model.safetensors, the model loads F32/BF16/F16"),
        ("blocks.0.self_attn.norm_q.weight", None, "1 missing (first: blocks.0.self_attn.norm_q.weight)"),
        ("blocks.0.adapter.weight", ((4,), "F32"), "1 unexpected (first: blocks.0.adapter.weight)"),
    ],
)
def test_refuses_mismatched_tensors(tmp_path, name, spec, found):
    """A wrong shape, a dtype the model cannot load, a missing or an unknown tensor: reported by
    inspection, refused by the loader before anything is allocated."""
    specs = checkpoint_specs(TEST)
    if spec is None:
        del specs[name]
    else:
        specs[name] = spec
    folder = write_header_only_folder(tmp_path, TEST, specs=specs)
    report = get_family("flashhead-pro").inspect(tmp_path)
    assert not report.ok and found in (report.problem() + "".join(report.mismatched))
    with pytest.raises(CheckpointError, match=f"{folder}: .*1 (missing|mismatched|unexpected)"):
        load_flashhead(tmp_path, "pro")


def test_refuses_a_short_header_and_a_wrong_config(tmp_path):
    folder = write_header_only_folder(tmp_path, TEST)
    weights = folder / "diffusion_pytorch_model.safetensors"
    write_header_only(weights, checkpoint_specs(TEST), size_delta=-1)
    with pytest.raises(CheckpointError, match="diffusion_pytorch_model.safetensors: truncated"):
        get_family("flashhead-pro").inspect(tmp_path)
    write_header_only(weights, checkpoint_specs(TEST))
    (folder / "config.json").write_text(json.dumps(model_config_json(TEST) | {"dim": 2048}))
    with pytest.raises(CheckpointError, match="config.json: dim 2048, FlashHead pro has 1536"):
        get_family("flashhead-pro").inspect(tmp_path)


def test_model_info_cli(tmp_path, capsys):
    write_header_only_folder(tmp_path / "ok", PRO)
    assert main(["model", "info", "--model", "flashhead-pro", "--weights", str(tmp_path / "ok"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ok"] and info["variant"] == "pro" and info["stored_params"] == 1_507_694_912
    assert info["generation_mode"] == "chunk_motion" and info["new_frames_per_chunk"] == 28
    # a pass's FLOPs by hand: the blocks' linears over the image tokens (cross-attention's k, v over each
    # latent's 32 audio tokens), self-attention over every token, each frame's tokens over its audio tokens
    n, d, audio = 9 * 32 * 32, PRO.dim, 9 * PRO.audio_tokens
    per_pass = PRO.n_blocks * (2 * n * (6 * d * d + 2 * d * PRO.ffn_dim) + 2 * audio * 2 * d * d
                               + 4 * n * n * d + 4 * n * PRO.audio_tokens * d)
    assert info["flops_denoise_per_chunk"] == pytest.approx(4 * per_pass, rel=2e-3)
    assert 60e12 < info["flops_decode_per_chunk"] < 80e12  # 3-D convs over 33 frames at 512x512
    assert info["flops_per_video_second"] == pytest.approx(info["flops_per_chunk"] * 25 / 28, rel=1e-9)
    assert main(["model", "info", "--model", "flashhead-lite", "--weights", "random", "--peak-tflops", "989"]) == 0
    table = capsys.readouterr().out
    assert "flashhead-lite" in table and "24" in table
    per_second = float(re.search(r"flops_per_video_second +([0-9.]+) TFLOP", table).group(1))
    assert int(re.search(r"sessions_at_most +(\d+)", table).group(1)) == int(989 // per_second)
    with pytest.raises(SystemExit, match="--peak-tflops must be > 0"):
        main(["model", "info", "--model", "flashhead-lite", "--weights", "random", "--peak-tflops", "nan"])
    specs = checkpoint_specs(PRO)
    del specs["blocks.29.ffn.2.bias"]
    write_header_only_folder(tmp_path / "broken", PRO, specs=specs)
    with pytest.raises(SystemExit, match=r"^charstream model info: .*Model_Pro: 1 missing \(first: blocks.29.ffn.2.bias\)$"):
        main(["model", "info", "--model", "flashhead-pro", "--weights", str(tmp_path / "broken")])
    with pytest.raises(SystemExit, match="charstream model info: .*Model_Pro: holds FlashHead Pro weights, not Lite|Model_Lite: missing"):
        main(["model", "info", "--model", "flashhead-lite", "--weights", str(tmp_path / "ok")])
    assert main(["model", "info", "--preset", "tiny", "--json"]) == 0  # the presets' report is unchanged
    assert json.loads(capsys.readouterr().out)["preset"] == "tiny"


def test_timestep_rounding_is_bf16s_and_survives_compile():
    """The DiT sees its timestep rounded to bf16 (1000/936/832/624): exactly a cast's rounding, also compiled
    (where a cast down and back up would be elided on CUDA)."""
    x = torch.cat([torch.tensor([1000.0, 937.5, 833.3333, 625.0, 0.0]), torch.rand(10_000) * 2000,
                   torch.randn(10_000) * 1e3])
    cast = x.to(torch.bfloat16).float()
    assert torch.equal(round_to_bf16(x), cast)
    assert round_to_bf16(torch.tensor([937.5, 833.3333, 625.0])).tolist() == [936.0, 832.0, 624.0]
    assert torch.equal(torch.compile(round_to_bf16)(x), cast)
