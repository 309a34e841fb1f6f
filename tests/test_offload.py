"""Small per-request work runs on the gateway's event loop; large work still goes to a thread (``gateway.offload``)."""

import asyncio
import base64
import io
import threading

import pytest
from PIL import Image

import gateway.images as images_mod
from gateway import offload
from gateway.errors import ApiError
from gateway.images import ImageLimits, ImageLoader
from gateway.prompt import PromptBuilder
from tests.test_prompt_builder import CountingProcessor, messages

LIMITS = ImageLimits(20 * 2**20, 4096 * 4096, 4096)


def data_url(size: tuple[int, int], fmt: str = "PNG") -> str:
    out = io.BytesIO()
    Image.new("RGB", size, (40, 90, 200)).save(out, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def decode_threads(monkeypatch) -> list[int]:
    """The thread ident of every pixel decode the loader runs from now on."""
    seen: list[int] = []
    real = images_mod.decode_pixels

    def recording(image, param=None):
        seen.append(threading.get_ident())
        return real(image, param)

    monkeypatch.setattr(images_mod, "decode_pixels", recording)
    return seen


def test_a_small_image_decodes_on_the_loop_and_a_large_one_in_a_thread(monkeypatch):
    seen = decode_threads(monkeypatch)
    loader = ImageLoader(LIMITS, fetcher=None)

    async def load(size):
        image = await loader.load(data_url(size), "messages[0].content[1]")
        return image, threading.get_ident()

    small, loop_thread = asyncio.run(load((48, 48)))
    # a flat 1024 x 1024 PNG is a few KiB of bytes but a million pixels to decode: judged by pixels
    large, loop_thread_2 = asyncio.run(load((1024, 1024)))
    assert small.image.size == (48, 48) and large.image.size == (1024, 1024)
    assert small.image.getpixel((0, 0)) == large.image.getpixel((5, 5)) == (40, 90, 200)   # decoded either way
    assert seen == [loop_thread, seen[1]] and seen[1] != loop_thread_2


def test_a_corrupt_small_image_is_still_a_400(monkeypatch):
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(out, "PNG")
    truncated = out.getvalue()[:-30]
    url = "data:image/png;base64," + base64.b64encode(truncated).decode()
    with pytest.raises(ApiError) as err:
        asyncio.run(ImageLoader(LIMITS, fetcher=None).load(url, "messages[0].content[1]"))
    assert err.value.status == 400 and err.value.param == "messages[0].content[1]"


def test_a_build_is_small_only_for_short_text_and_learnt_image_sizes(prompts):
    counting = CountingProcessor(prompts.processor)
    builder = PromptBuilder(counting, prompts.context_length)
    image = Image.new("RGB", (64, 64))
    assert builder.cheap_build(messages(0), [])
    assert not builder.cheap_build(messages(1), [image])   # a new size runs the processor over its pixels
    builder.build_prompt(messages(1), [image])
    assert builder.cheap_build(messages(1), [image])       # learnt: only the text is tokenized
    assert not builder.cheap_build(messages(1), [Image.new("RGB", (65, 64))])
    assert not builder.cheap_build(messages(0, "x" * (offload.INLINE_MAX_TEXT_CHARS + 1)), [])
    assert not builder.cheap_build(messages(0), [], tools=[{"type": "function", "function": {"name": "f"}}])


def test_the_size_rules():
    assert offload.small_text(["a" * 10, "b" * (offload.INLINE_MAX_TEXT_CHARS - 10)])
    assert not offload.small_text(["a" * 10, "b" * (offload.INLINE_MAX_TEXT_CHARS - 9)])
    assert offload.small_images([(256, 256)]) and not offload.small_images([(256, 256), (1, 1)])

    async def where(inline: bool) -> bool:
        return await offload.run(inline, threading.get_ident) == threading.get_ident()

    assert asyncio.run(where(True)) and not asyncio.run(where(False))


async def test_a_requests_images_share_the_bound_on_the_loop(monkeypatch, backend, prompts):
    """A 200 x 200 image alone decodes on the loop; two of them in one request are over the bound
    together, so each decodes in a thread. Through the gateway's HTTP API, answered by the demo model."""
    from tests.test_gateway_api import serve

    seen = decode_threads(monkeypatch)

    def body(n: int) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": data_url((200, 200))}} for _ in range(n)]
        return {"model": "demo-vlm", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}]}]}

    async with serve(backend, prompts) as client:
        alone = await client.post("/v1/chat/completions", json=body(1))
        assert alone.status_code == 200 and seen == [threading.get_ident()]
        two = await client.post("/v1/chat/completions", json=body(2))
        assert two.status_code == 200, two.text
        assert len(seen) == 3 and threading.get_ident() not in seen[1:]
