"""Prompt token ids: the image-size shortcut must give exactly what the model's processor gives."""

from PIL import Image

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
