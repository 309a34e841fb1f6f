"""Prompt token ids: the image-size shortcut must give exactly what the model's processor gives."""

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from gateway.errors import ApiError
from gateway.openai_schema import ChatCompletionRequest
from gateway.prompt import PromptBuilder


def messages(n_images: int, text: str = "what is in the image?"):
    parts = [{"type": "text", "text": text}]
    for i in range(n_images):
        parts += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                  {"type": "text", "text": f"and picture {i}"}]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": parts}]}).messages


class CountingProcessor:
    """The real processor, counting calls; ``wrap_images`` makes its expansion more than a repeat."""

    def __init__(self, real, wrap_images: bool = False):
        self.real, self.calls, self.wrap_images = real, 0, wrap_images
        self.tokenizer, self.image_processor, self.image_token = real.tokenizer, real.image_processor, real.image_token

    def apply_chat_template(self, *args, **kwargs):
        return self.real.apply_chat_template(*args, **kwargs)

    def __call__(self, **kwargs):
        self.calls += 1
        ids = list(self.real(**kwargs)["input_ids"][0])
        if self.wrap_images:  # a boundary token after every image run, like <img>...</img> processors
            image_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
            ids = [t for i, x in enumerate(ids) for t in ([x, 5] if x == image_id and (i + 1 == len(ids) or ids[i + 1] != x) else [x])]
        return {"input_ids": [ids]}


def test_shortcut_matches_the_processor_for_every_size_and_skips_it_once_learnt(prompts):
    counting = CountingProcessor(prompts.processor)
    builder = PromptBuilder(counting, prompts.context_length)
    sizes = [(64, 64), (97, 33), (300, 200)]
    for n in (1, 2):
        for size in sizes:
            images = [Image.new("RGB", size, (10, 200, 30))] * n
            assert builder.build(messages(n), images) == prompts._process(prompts.render(messages(n)), images)
    calls = counting.calls
    for n in (1, 2, 3):
        images = [Image.new("RGB", size) for size in sizes[:n]]
        assert builder.build(messages(n, "another question"), images) == prompts._process(
            prompts.render(messages(n, "another question")), images)
    assert counting.calls == calls  # every size known: the image processor never ran again


def test_a_processor_that_expands_into_other_tokens_turns_the_shortcut_off(prompts):
    wrapping = CountingProcessor(prompts.processor, wrap_images=True)
    builder = PromptBuilder(wrapping, prompts.context_length)
    image = Image.new("RGB", (64, 64))
    expected = wrapping(text=prompts.render(messages(1)), images=[image], add_special_tokens=False)["input_ids"][0]
    for _ in range(3):
        assert builder.build(messages(1), [image]) == expected
    assert wrapping.calls == 4  # the processor ran every time


# -- a prompt that cannot fit is refused before the expensive work (issue 15, defect 6) ----------
class Counted:
    """Counts calls on the real tokenizer and the real processor: ``__class__`` is swapped on deep copies of them."""

    tokenizer_calls = 0
    renders = 0


def counting_copy(processor):
    proc = copy.deepcopy(processor)
    tokenizer_class, processor_class = type(proc.tokenizer), type(proc)

    class CountingTokenizer(tokenizer_class):
        def __call__(self, *args, **kwargs):
            Counted.tokenizer_calls += 1
            return super().__call__(*args, **kwargs)

    class CountingProcessor(processor_class):
        def apply_chat_template(self, *args, **kwargs):
            Counted.renders += 1
            return super().apply_chat_template(*args, **kwargs)

    proc.tokenizer.__class__ = CountingTokenizer
    proc.__class__ = CountingProcessor
    Counted.tokenizer_calls = Counted.renders = 0
    return proc


def chat_messages(*messages: dict):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": list(messages)}).messages


FOUR_MB = "hello world " * 350_000


def test_a_4_mb_prompt_is_refused_without_rendering_or_tokenizing(prompts):
    builder = PromptBuilder(counting_copy(prompts.processor), prompts.context_length)
    builder.build(chat_messages({"role": "user", "content": "hello"}), [])
    assert Counted.tokenizer_calls >= 1 and Counted.renders == 1   # the counters see real calls
    Counted.tokenizer_calls = Counted.renders = 0
    huge = chat_messages({"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": FOUR_MB}]})
    with pytest.raises(ApiError) as refused:
        builder.build(huge, [])
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    # the floor's bound, never above the real count: characters over the longest token's length
    assert f"at least {builder.floor.tokens_at_least(['look', FOUR_MB])} tokens" in refused.value.message
    assert Counted.tokenizer_calls == 0 and Counted.renders == 0


def test_a_huge_system_turn_is_refused_after_rendering_but_before_tokenizing(prompts):
    builder = PromptBuilder(counting_copy(prompts.processor), prompts.context_length)
    huge = chat_messages({"role": "system", "content": FOUR_MB}, {"role": "user", "content": "hi"})
    with pytest.raises(ApiError) as refused:
        builder.build(huge, [])
    assert refused.value.code == "context_length_exceeded"
    assert Counted.renders == 1 and Counted.tokenizer_calls == 0


def test_a_prompt_just_inside_the_context_is_not_refused_by_the_bound(prompts):
    builder = PromptBuilder(prompts.processor, prompts.context_length)
    words = "red " * (prompts.context_length - 40)
    ids = builder.build(chat_messages({"role": "user", "content": words}), [])
    assert prompts.context_length - 40 < len(ids) < prompts.context_length


# -- builds run in parallel (issue 15, defect 6) ----------------------------------------------------
def test_two_builds_are_in_flight_at_once(prompts):
    """Each build's template waits until the other one is in its template too: serialized builds would time out."""
    proc = copy.deepcopy(prompts.processor)
    barrier = threading.Barrier(2, timeout=20)

    class MeetingProcessor(type(proc)):
        def apply_chat_template(self, *args, **kwargs):
            barrier.wait()
            return super().apply_chat_template(*args, **kwargs)

    proc.__class__ = MeetingProcessor
    builder = PromptBuilder(proc, prompts.context_length)
    images = [Image.new("RGB", (64, 64), (200, 10, 10))]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: builder.build(messages(1), images), range(2)))
    expected = prompts._process(prompts.render(messages(1)), images)
    assert results == [expected, expected]
    assert builder._processors.size == 2   # two independent processor copies were in use
