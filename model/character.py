"""The character: a procedural 2-D talking face, rasterised with torch at 128x128.

A character is an ``Identity`` (colours and proportions drawn from a seed) plus per-frame
``Motion`` (head offset, eye closure, mouth openness and roundness). Every shape is an ellipse
drawn with a one-pixel anti-aliased edge from its signed distance, so the renderer is batched
over frames and runs the same on CPU or GPU.

The layout is fixed on purpose: the mouth always sits near ``MOUTH_CENTER``, its interior is
near-black and the skin around it is bright, so the lip-sync scorer can read mouth openness
from any generated frame by counting dark pixels in ``MOUTH_BOX``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SIZE = 128
MOUTH_CENTER = (64.0, 83.0)  # (x, y) at rest, in pixels
# (y0, y1, x0, x1): holds the mouth at full opening under the largest head offset (MAX_SHIFT);
# inside it there is only skin, neck, lips and mouth, never the (possibly dark) background.
MOUTH_BOX = (66, 101, 48, 80)
MAX_SHIFT = 3.0  # pixels of head motion each way
MOUTH_MAX_OPEN = 9.0  # interior half-height at openness 1, pixels


@dataclass(frozen=True)
class Identity:
    background: tuple[float, float, float]
    background2: tuple[float, float, float]  # vertical gradient to
    skin: tuple[float, float, float]
    hair: tuple[float, float, float]
    shirt: tuple[float, float, float]
    iris: tuple[float, float, float]
    lips: tuple[float, float, float]
    head_rx: float
    head_ry: float
    hair_height: float  # how far the hair cap reaches down the forehead
    eye_dx: float  # half distance between the eyes
    mouth_rx: float


@dataclass
class Motion:
    """Per-frame controls, each a float array of shape (T,)."""

    shift_x: np.ndarray
    shift_y: np.ndarray
    eye_open: np.ndarray  # 1 open, 0 closed
    mouth_open: np.ndarray  # 0 closed .. 1 wide open
    mouth_round: np.ndarray  # 0 spread .. 1 rounded (narrower, taller)

    def __len__(self) -> int:
        return len(self.mouth_open)


def make_identity(seed: int) -> Identity:
    """Colours and proportions from ``seed``; skin stays bright so the dark mouth stands out."""
    rng = np.random.default_rng([seed, 0x1D])

    def colour(lo: float, hi: float) -> tuple[float, float, float]:
        return tuple(float(v) for v in rng.uniform(lo, hi, 3))

    skin_tone = rng.uniform(0.62, 0.95)
    skin = (skin_tone, skin_tone * rng.uniform(0.72, 0.86), skin_tone * rng.uniform(0.55, 0.75))
    return Identity(
        background=colour(0.15, 0.9),
        background2=colour(0.15, 0.9),
        skin=tuple(float(v) for v in skin),
        hair=colour(0.05, 0.6),
        shirt=colour(0.1, 0.9),
        iris=colour(0.05, 0.6),
        lips=(float(rng.uniform(0.6, 0.85)), float(rng.uniform(0.25, 0.45)), float(rng.uniform(0.3, 0.45))),
        head_rx=float(rng.uniform(32, 38)),
        head_ry=float(rng.uniform(40, 45)),
        hair_height=float(rng.uniform(0.25, 0.5)),
        eye_dx=float(rng.uniform(12, 15)),
        mouth_rx=float(rng.uniform(9, 12)),
    )


def idle_motion(n_frames: int, seed: int, fps: int = 24) -> Motion:
    """Head sway and blinks (random intervals, ~4-frame blinks), mouth closed."""
    rng = np.random.default_rng([seed, 0xB1])
    t = np.arange(n_frames) / fps
    shift_x = np.zeros(n_frames)
    shift_y = np.zeros(n_frames)
    for amp, arr in ((MAX_SHIFT * 0.6, shift_x), (MAX_SHIFT * 0.4, shift_y)):
        for _ in range(2):  # two slow sinusoids of random period and phase
            arr += amp / 2 * np.sin(2 * np.pi * t / rng.uniform(2.0, 6.0) + rng.uniform(0, 2 * np.pi))
    eye_open = np.ones(n_frames)
    frame = int(rng.uniform(0.5, 3.0) * fps)
    while frame < n_frames:
        for k, v in enumerate((0.5, 0.0, 0.0, 0.5)):
            if frame + k < n_frames:
                eye_open[frame + k] = v
        frame += int(rng.uniform(2.0, 5.0) * fps)
    zeros = np.zeros(n_frames)
    return Motion(np.clip(shift_x, -MAX_SHIFT, MAX_SHIFT), np.clip(shift_y, -MAX_SHIFT, MAX_SHIFT),
                  eye_open, zeros.copy(), zeros.copy())


def _ellipse(xx: torch.Tensor, yy: torch.Tensor, cx, cy, rx, ry) -> torch.Tensor:
    """Coverage in [0, 1] of an axis-aligned ellipse, anti-aliased over about one pixel.

    cx, cy, rx, ry broadcast as (T, 1, 1) tensors or floats; the result is (T, H, W).
    """
    d = torch.sqrt(((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2)
    # distance to the edge in pixels, approximately: (d - 1) * mean radius
    return torch.clamp(0.5 - (d - 1.0) * (rx + ry) / 2, 0.0, 1.0)


def _paint(img: torch.Tensor, alpha: torch.Tensor, colour) -> torch.Tensor:
    c = torch.as_tensor(colour, dtype=img.dtype, device=img.device).view(1, 3, 1, 1)
    return img.lerp_(c.expand_as(img), alpha.unsqueeze(1))


def render(identity: Identity, motion: Motion, device: str | torch.device = "cpu") -> torch.Tensor:
    """Frames as uint8 (T, 3, 128, 128)."""
    n = len(motion)
    f32 = dict(dtype=torch.float32, device=device)
    ys = torch.arange(SIZE, **f32).view(1, SIZE, 1) + 0.5
    xs = torch.arange(SIZE, **f32).view(1, 1, SIZE) + 0.5

    def per_frame(a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a, np.float32), **f32).view(n, 1, 1)

    sx, sy = per_frame(motion.shift_x), per_frame(motion.shift_y)
    eye_open = per_frame(motion.eye_open)
    mouth_open = per_frame(np.clip(motion.mouth_open, 0, 1))
    mouth_round = per_frame(np.clip(motion.mouth_round, 0, 1))
    ident = identity

    grad = (ys / SIZE).expand(n, SIZE, SIZE)
    bg0 = torch.as_tensor(ident.background, **f32).view(1, 3, 1, 1)
    bg1 = torch.as_tensor(ident.background2, **f32).view(1, 3, 1, 1)
    img = bg0 * (1 - grad.unsqueeze(1)) + bg1 * grad.unsqueeze(1)

    hx, hy = 64.0 + sx, 60.0 + sy
    # shoulders and neck move half as much as the head
    img = _paint(img, _ellipse(xs, ys, 64.0 + sx / 2, 142.0, 58.0, 36.0), ident.shirt)
    img = _paint(img, _ellipse(xs, ys, 64.0 + sx / 2, 100.0, 18.0, 20.0), tuple(v * 0.85 for v in ident.skin))
    # hair behind the head, then the face, then the hair cap over the forehead
    img = _paint(img, _ellipse(xs, ys, hx, hy - 4.0, ident.head_rx + 4.0, ident.head_ry + 2.0), ident.hair)
    img = _paint(img, _ellipse(xs, ys, hx, hy, ident.head_rx, ident.head_ry), ident.skin)
    cap_bottom = hy - ident.head_ry * (1.0 - 2.0 * ident.hair_height)
    cap = _ellipse(xs, ys, hx, hy - 6.0, ident.head_rx + 2.0, ident.head_ry - 2.0)
    cap = cap * torch.clamp(cap_bottom - ys + 0.5, 0.0, 1.0)
    img = _paint(img, cap, ident.hair)
    # eyes: white, iris, then the lid (skin) closing from above as eye_open falls
    eye_y = hy - 6.0
    for side in (-1.0, 1.0):
        ex = hx + side * ident.eye_dx
        white = _ellipse(xs, ys, ex, eye_y, 6.0, 4.5)
        img = _paint(img, white, (0.97, 0.97, 0.97))
        img = _paint(img, _ellipse(xs, ys, ex, eye_y, 3.0, 3.0) * white, ident.iris)
        img = _paint(img, _ellipse(xs, ys, ex, eye_y, 1.3, 1.3) * white, (0.02, 0.02, 0.02))
        lid_edge = eye_y - 5.0 + 10.0 * (1.0 - eye_open)
        lid = _ellipse(xs, ys, ex, eye_y, 6.6, 5.1) * torch.clamp(lid_edge - ys + 0.5, 0.0, 1.0)
        img = _paint(img, lid, tuple(v * 0.93 for v in ident.skin))
        brow = _ellipse(xs, ys, ex, eye_y - 8.0 - 1.5 * (1 - eye_open), 6.5, 1.4)
        img = _paint(img, brow, tuple(v * 0.8 for v in ident.hair))
    # nose: a slightly darker skin patch well above the mouth box
    img = _paint(img, _ellipse(xs, ys, hx, hy + 10.0, 3.5, 5.0), tuple(v * 0.88 for v in ident.skin))
    # mouth: lips grow with openness; rounding narrows and heightens it; dark interior and teeth
    mx, my = MOUTH_CENTER[0] + sx, MOUTH_CENTER[1] + sy
    width = ident.mouth_rx * (1.0 - 0.35 * mouth_round)
    inner_ry = 0.4 + MOUTH_MAX_OPEN * mouth_open * (1.0 + 0.25 * mouth_round)
    img = _paint(img, _ellipse(xs, ys, mx, my, width + 2.5, inner_ry + 2.5), ident.lips)
    inner = _ellipse(xs, ys, mx, my, width, inner_ry)
    img = _paint(img, inner, (0.08, 0.02, 0.03))
    teeth = inner * torch.clamp(my - inner_ry + 2.5 - ys + 0.5, 0.0, 1.0)
    img = _paint(img, teeth * (mouth_open > 0.15).float(), (0.92, 0.92, 0.88))
    return (img.clamp(0, 1) * 255.0 + 0.5).to(torch.uint8)


def reference_frame(identity: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The identity's rest frame (eyes open, mouth closed, centred): the sink/reference image."""
    ident: Identity = make_identity(identity)
    z = np.zeros(1)
    return render(ident, Motion(z, z, np.ones(1), z, z), device)[0]
