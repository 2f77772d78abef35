"""The media timeline per model: derived sizes, and a timeline whose frames would drift refused."""

import pytest

from charstream.timeline import CHARACTERS, Timeline


def test_characters_timeline_figures():
    assert (CHARACTERS.fps, CHARACTERS.frames_per_chunk, CHARACTERS.rate) == (24, 4, 48_000)
    assert (CHARACTERS.samples_per_frame, CHARACTERS.samples_per_chunk) == (2_000, 8_000)
    assert CHARACTERS.chunk_seconds == pytest.approx(1 / 6)


def test_flashhead_timeline_figures():
    from charstream.model.families import get_family

    timeline = get_family("flashhead-pro").timeline
    assert (timeline.fps, timeline.frames_per_chunk) == (25, 28)
    assert (timeline.samples_per_frame, timeline.samples_per_chunk) == (1_920, 53_760)
    assert timeline.chunk_seconds == pytest.approx(1.12)


@pytest.mark.parametrize("fps, frames", [(23, 4), (0, 4), (24, 0)])
def test_a_timeline_that_would_drift_or_stand_still_is_refused(fps, frames):
    with pytest.raises(ValueError, match="timeline"):
        Timeline(fps=fps, frames_per_chunk=frames)
