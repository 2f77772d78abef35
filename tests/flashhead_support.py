"""Writing FlashHead weights folders as users have them (the released layout, original key names),
either with seeded random data or header-only (a sparse file of the full size: headers are all that
inspection reads, so the real 1.5 B-parameter sizes cost no memory or disk)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from charstream.model.families.flashhead.config import FlashHeadConfig
from charstream.model.families.flashhead.loader import DTYPE_BYTES, unused_shapes, used_shapes

STEM = "diffusion_pytorch_model"


def model_config_json(cfg: FlashHeadConfig) -> dict:
    """The fields of the released Model_*/config.json."""
    return {
        "_class_name": "WanModelAudioProject",
        "dim": cfg.dim, "in_dim": cfg.in_channels, "ffn_dim": cfg.ffn_dim, "out_dim": cfg.latent_channels,
        "text_dim": cfg.text_dim, "freq_dim": cfg.freq_dim, "eps": cfg.eps, "vae_stride": list(cfg.vae_stride),
        "patch_size": list(cfg.patch), "num_heads": cfg.n_heads, "num_layers": cfg.n_blocks,
        "has_image_input": False,
    }  # fmt: skip


def shard_of(name: str) -> str:
    """Blocks one shard each, the adapter and unused tensors one, the small rest one."""
    if name.startswith("blocks."):
        return "block" + name.split(".")[1]
    if name.startswith(("audio_proj.", "text_embedding.", "audio_emb.", "time_projection.")):
        return "large"
    return "small"


def write_sharded(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """``state`` as diffusers writes a sharded model: numbered shards and a .safetensors.index.json."""
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        groups.setdefault(shard_of(name), {})[name] = tensor.contiguous()
    weight_map = {}
    for i, group in enumerate(sorted(groups), start=1):
        file = f"{STEM}-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(groups[group], str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(groups[group], file)
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / f"{STEM}.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_header_only(path: Path, specs: dict[str, tuple[tuple[int, ...], str]], size_delta: int = 0) -> None:
    """A safetensors file whose data is a hole of the right size (``size_delta`` shortens or pads it)."""
    header, offset = {}, 0
    for name, (shape, dtype) in sorted(specs.items()):
        end = offset + math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
    with open(path, "r+b") as f:
        f.truncate(8 + len(blob) + offset + size_delta)


def checkpoint_specs(cfg: FlashHeadConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (shape, "F32") for name, shape in (used_shapes(cfg) | unused_shapes(cfg)).items()}


def write_extras(root: Path, cfg: FlashHeadConfig, wav2vec2: Path | None = None) -> None:
    """The VAE file of the variant (a small real torch zip: its tensors are the VAE's to check) and a
    header-only wav2vec2-base folder unless a real one is given (then linked beside the folder)."""
    if cfg.variant == "pro":
        (root / "VAE_Wan").mkdir()
        torch.save({"encoder.conv1.weight": torch.zeros(4, 3)}, root / "VAE_Wan" / "Wan2.1_VAE.pth")
    else:
        (root / "VAE_LTX").mkdir()
        (root / "VAE_LTX" / "config.json").write_text("{}")
        write_header_only(root / "VAE_LTX" / f"{STEM}.safetensors", {"decoder.conv_in.weight": ((4, 3), "F32")})
    target = root / "wav2vec2-base-960h"
    if wav2vec2 is not None:
        target.symlink_to(wav2vec2)
        return
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 768, "num_hidden_layers": 12}))
    write_header_only(target / "model.safetensors", {"wav2vec2.masked_spec_embed": ((768,), "F32")})


def write_header_only_folder(root: Path, cfg: FlashHeadConfig, model_dir: str | None = None, specs=None) -> Path:
    """A released folder of ``cfg``'s sizes with header-only DiT weights (one file); returns the model folder."""
    root.mkdir(parents=True, exist_ok=True)
    folder = root / (model_dir or {"pro": "Model_Pro", "lite": "Model_Lite"}[cfg.variant])
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_config_json(cfg)))
    write_header_only(folder / f"{STEM}.safetensors", specs if specs is not None else checkpoint_specs(cfg))
    write_extras(root, cfg)
    return folder


def write_wav2vec2(folder: Path, seed: int) -> Path:
    """Seeded random wav2vec2-base-960h weights in transformers' format: a CTC model's names (as released)
    in model.safetensors beside its config.json and feature extractor config. Weights N(0, 1/fan_in), norms
    1 (quicker than the library's own initialisation, and as well-scaled)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.Wav2Vec2Config(vocab_size=32, architectures=["Wav2Vec2ForCTC"])
    with torch.device("meta"):
        names = {k: v.shape for k, v in transformers.Wav2Vec2ForCTC(config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in names.items():
        if len(shape) >= 2:
            state[name] = torch.randn(shape, generator=g) / shape[1:].numel() ** 0.5
        else:
            state[name] = torch.ones(shape) if "norm" in name and name.endswith("weight") else 0.02 * torch.randn(shape, generator=g)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "do_normalize": True, "feature_extractor_type": "Wav2Vec2FeatureExtractor", "feature_size": 1,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False, "sampling_rate": 16000}))
    return folder

