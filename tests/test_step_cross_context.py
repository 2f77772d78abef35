"""The fused step's cross-attention K/V (model/step/fused.py ``FusedCrossContext``): every block's K/V from one
FP8 GEMM over all blocks' weights and one norm of all keys, handed out as views of the one output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charstream.model.config import TINY
from charstream.model.dit import DiT
from charstream.model.step.fused import FusedCrossContext

CFG = TINY.with_(n_blocks=3)


def _model() -> DiT:
    model = DiT(CFG).init_random_(7).eval().requires_grad_(False)
    for i, block in enumerate(model.blocks):  # norms that differ per block, so a mixed-up block shows
        block.cross_k_norm.weight.copy_(torch.rand(CFG.head_dim, generator=torch.Generator().manual_seed(i)) + 0.5)
    return model


def test_every_blocks_cross_kv_from_one_gemm_as_the_blocks_compute_it():
    model = _model()
    context = torch.randn(CFG.n_audio_tokens, CFG.dim, generator=torch.Generator().manual_seed(1))
    fused = FusedCrossContext(model)
    got = fused(context)
    assert len(got) == CFG.n_blocks
    rows = 2 * CFG.n_heads * CFG.head_dim
    weight = fused.kv.weight.float() * fused.kv.scale.t()  # the FP8 weights as the GEMM reads them
    for i, ((k, v), block) in enumerate(zip(got, model.blocks, strict=True)):
        assert k.shape == v.shape == (CFG.n_heads, CFG.n_audio_tokens, CFG.head_dim)
        # the same math over the same (FP8) weights: block i's rows of the one weight, normed keys
        kv = (context @ weight[i * rows : (i + 1) * rows].t()).unflatten(-1, (2, CFG.n_heads, CFG.head_dim))
        k_ref = F.rms_norm(kv[:, 0], (CFG.head_dim,), eps=block.cross_k_norm.eps) * block.cross_k_norm.weight
        torch.testing.assert_close(k, k_ref.transpose(0, 1), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, kv[:, 1].transpose(0, 1), rtol=1e-5, atol=1e-6)
        # and the block's own module path (its unquantized weights), within FP8's rounding of them
        k_mod, v_mod = (t[0, 0] for t in block.cross_context(context[None, None]))
        for a, b in ((k, k_mod), (v, v_mod)):
            rel = ((a - b).norm() / b.norm()).item()
            assert 1e-4 < rel < 0.05, rel  # FP8 weights (not the module's), close to them
    # views of one output, no copy per block
    assert len({t.untyped_storage().data_ptr() for kv in got for t in kv}) == 1
