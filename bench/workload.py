"""The synthetic workload: an image pool and one chat request per benchmark slot.

Images are the demo model's own kind (one coloured shape on a plain light
background, drawn by ``runtime.demo_model.shapes``), so the served demo model can
answer them and each image carries its true answer, ``"a <colour> <shape>"``.
Any other VLM server gets ordinary small PNGs.

Everything is a pure function of the seed:

- image ``k`` of the pool depends only on ``(seed, k)``, so a pool of 4 is the
  first half of a pool of 8;
- requests use the pool round-robin in a seeded shuffled order, so exactly
  ``min(pool, requests)`` distinct images are sent and the share of requests
  whose image was already sent is ``1 - min(pool, requests) / requests``
  (the encoder-cache reuse a server can at best achieve);
- exactly ``round(long_fraction * requests)`` requests are long documents: filler
  text of ``long_prompt_words`` simple lowercase words before the question.
"""

from __future__ import annotations

import base64
import hashlib
import io
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.demo_model.shapes import draw_shape

QUESTION = "what is in the image?"

# Common lowercase words every word-level tokenizer (the demo model's included)
# knows. No colour or shape words, so a long document never hints at an answer.
FILLER_WORDS: tuple[str, ...] = tuple(
    (
        "the a of and to in is it for on with as at by from this some be was are have "
        "has had will would can could time year day week way thing people world life hand "
        "part place work story book word line number group water room money question answer "
        "make take get give know think look use find tell ask"
    ).split()
)

_MAX_DRAW_ATTEMPTS = 100


@dataclass(frozen=True, slots=True)
class PoolImage:
    """One image of the pool, ready to send."""

    data_url: str  # data:image/png;base64,...
    answer: str  # "a <colour> <shape>"
    sha256: str  # of the PNG bytes; distinct within a pool


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What one benchmark request sends and what its answer should be."""

    index: int
    image_index: int
    long: bool
    messages: list[dict[str, Any]]
    answer: str


@dataclass(frozen=True, slots=True)
class Workload:
    images: list[PoolImage]
    requests: list[RequestSpec]

    def summary(self) -> dict[str, Any]:
        distinct = len({r.image_index for r in self.requests})
        return {
            "distinct_images": distinct,
            "image_reuse_ratio": 1.0 - distinct / len(self.requests),
            "long_requests": sum(r.long for r in self.requests),
        }


def _png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def make_image_pool(size: int, seed: int, image_size: int | None = None) -> list[PoolImage]:
    """``size`` distinct images; image ``k`` depends only on ``(seed, k, image_size)``."""
    pool: list[PoolImage] = []
    seen: set[str] = set()
    for k in range(size):
        for attempt in range(_MAX_DRAW_ATTEMPTS):
            sample = draw_shape(random.Random(f"epd-bench/{seed}/{k}/{attempt}"), size=image_size)
            buffer = io.BytesIO()
            sample.image.save(buffer, format="PNG")
            png = buffer.getvalue()
            digest = hashlib.sha256(png).hexdigest()
            if digest not in seen:
                break
        else:  # pragma: no cover - needs ~1e5 identical draws
            raise RuntimeError(f"could not draw {size} distinct images")
        seen.add(digest)
        pool.append(PoolImage(_png_data_url(png), sample.answer, digest))
    return pool


def filler_text(words: int, rng: np.random.Generator) -> str:
    return " ".join(FILLER_WORDS[i] for i in rng.integers(0, len(FILLER_WORDS), size=words))


def make_messages(image: PoolImage, text: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image.data_url}},
                {"type": "text", "text": text},
            ],
        }
    ]


def build_workload(
    requests: int,
    image_pool: int,
    seed: int,
    long_fraction: float = 0.0,
    long_prompt_words: int = 1000,
    image_size: int | None = None,
) -> Workload:
    images = make_image_pool(image_pool, seed, image_size)
    rng = np.random.default_rng([seed, 1])  # stream 1: request mix (stream 0 is arrivals)
    order = rng.permutation(np.arange(requests) % image_pool)
    n_long = round(long_fraction * requests)
    is_long = np.zeros(requests, dtype=bool)
    is_long[rng.permutation(requests)[:n_long]] = True
    specs = []
    for i in range(requests):
        image = images[int(order[i])]
        text = f"{filler_text(long_prompt_words, rng)} {QUESTION}" if is_long[i] else QUESTION
        specs.append(RequestSpec(i, int(order[i]), bool(is_long[i]), make_messages(image, text), image.answer))
    return Workload(images, specs)
