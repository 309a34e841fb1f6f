"""The demo model's shape images as the data URLs a client sends, for end-to-end tests."""

from __future__ import annotations

import base64
import io
import random

from runtime.demo_model.shapes import ShapeSample, draw_shape


def shape_data_url(seed: int) -> tuple[str, ShapeSample]:
    """The PNG data URL of the shape drawn from ``seed``, and the sample (its answer, colour, shape)."""
    sample = draw_shape(random.Random(seed))
    buf = io.BytesIO()
    sample.image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), sample
