"""Synthetic images for the demo model: one coloured shape on a plain light background."""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
QUESTIONS: tuple[str, ...] = (
    "what is in the image ?",
    "what do you see ?",
    "describe the image .",
    "what shape is shown ?",
)


@dataclass(frozen=True, slots=True)
class ShapeSample:
    image: Image.Image
    colour: str
    shape: str

    @property
    def answer(self) -> str:
        return f"a {self.colour} {self.shape}"

    @property
    def label(self) -> int:
        """Index in the 12-way colour x shape classification used for warm-up."""
        return list(COLOURS).index(self.colour) * len(SHAPES) + SHAPES.index(self.shape)


def draw_shape(rng: random.Random, size: int | None = None, colour: str | None = None, shape: str | None = None) -> ShapeSample:
    """Draw one sample; every random choice comes from ``rng`` so a seed fixes the image."""
    size = size or rng.choice((32, 48, 64, 96, 128))
    colour = colour or rng.choice(list(COLOURS))
    shape = shape or rng.choice(SHAPES)
    background = tuple(rng.randint(215, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    extent = rng.uniform(0.45, 0.8) * size
    x0 = rng.uniform(0, size - extent)
    y0 = rng.uniform(0, size - extent)
    box = (x0, y0, x0 + extent, y0 + extent)
    fill = tuple(max(0, min(255, c + rng.randint(-15, 15))) for c in COLOURS[colour])
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + extent / 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=fill)
    return ShapeSample(image, colour, shape)
