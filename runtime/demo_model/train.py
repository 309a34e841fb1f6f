"""Seeded training of the demo VLM on synthetic shapes.

Two phases (both on CPU, about three minutes on 2 cores):
1. warm-up: the vision tower learns the 12-way colour x shape classification
   (shape is slow to learn through the language model alone);
2. the whole VLM learns to answer "a <colour> <shape>" after a question.
The result must reach >= 95% exact answers on 200 held-out images, else training
fails loudly rather than shipping a weak model.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from .shapes import QUESTIONS, SHAPES, COLOURS, ShapeSample, draw_shape

log = logging.getLogger("epd.demo_model")

REQUIRED_ACCURACY = 0.95


@dataclass(slots=True)
class TrainPlan:
    seed: int = 0
    train_images: int = 8000
    eval_images: int = 200
    warmup_steps: int = 600
    vlm_steps: int = 1800
    batch_size: int = 32
    lr: float = 2e-3


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _pixels(processor: LlavaProcessor, samples: list[ShapeSample]) -> torch.Tensor:
    return processor.image_processor([s.image for s in samples], return_tensors="pt")["pixel_values"]


def _warm_up_vision(model: LlavaForConditionalGeneration, pixels: torch.Tensor, labels: torch.Tensor, plan: TrainPlan) -> None:
    tower = model.model.vision_tower
    head = nn.Linear(tower.config.hidden_size, len(COLOURS) * len(SHAPES))
    opt = torch.optim.AdamW([*tower.parameters(), *head.parameters()], lr=plan.lr)
    gen = torch.Generator().manual_seed(plan.seed)
    for step in range(plan.warmup_steps):
        idx = torch.randint(0, len(pixels), (plan.batch_size * 2,), generator=gen)
        hidden = tower(pixel_values=pixels[idx]).last_hidden_state[:, 1:].mean(dim=1)
        loss = nn.functional.cross_entropy(head(hidden), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            log.info("vision warm-up step %d loss %.3f", step, loss.item())


def _vlm_batch(processor: LlavaProcessor, samples: list[ShapeSample], rng: random.Random) -> dict[str, torch.Tensor]:
    tok = processor.tokenizer
    prompts = [processor.apply_chat_template(_messages(rng.choice(QUESTIONS)), add_generation_prompt=True) for _ in samples]
    enc = processor(images=[s.image for s in samples], text=prompts, return_tensors="pt", padding=True)
    # Append " a colour shape <|end|>" after each prompt; loss on those tokens only.
    rows, label_rows = [], []
    for i, s in enumerate(samples):
        prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        answer_ids = tok(f"{s.answer} {tok.eos_token}", add_special_tokens=False)["input_ids"]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, label_rows)):
        input_ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(l)] = torch.tensor(l)
        mask[i, : len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "pixel_values": enc["pixel_values"], "labels": labels}


@torch.no_grad()
def evaluate(model: LlavaForConditionalGeneration, processor: LlavaProcessor, samples: list[ShapeSample]) -> float:
    """Exact-answer accuracy of greedy ``generate()`` on ``samples``."""
    model.eval()
    correct = 0
    for s in samples:
        prompt = processor.apply_chat_template(_messages(QUESTIONS[0]), add_generation_prompt=True)
        enc = processor(images=[s.image], text=prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
        text = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += text.strip() == s.answer
    return correct / len(samples)


def train(model: LlavaForConditionalGeneration, processor: LlavaProcessor, plan: TrainPlan) -> float:
    torch.manual_seed(plan.seed)
    rng = random.Random(plan.seed)
    started = time.monotonic()
    train_set = [draw_shape(rng) for _ in range(plan.train_images)]
    eval_set = [draw_shape(random.Random(10_000 + plan.seed + i)) for i in range(plan.eval_images)]
    pixels = _pixels(processor, train_set)
    labels = torch.tensor([s.label for s in train_set])

    model.train()
    _warm_up_vision(model, pixels, labels, plan)

    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=plan.lr, total_steps=plan.vlm_steps, pct_start=0.1)
    for step in range(plan.vlm_steps):
        batch = _vlm_batch(processor, rng.sample(train_set, plan.batch_size), rng)
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            log.info("vlm step %d loss %.3f", step, loss.item())

    accuracy = evaluate(model, processor, eval_set)
    log.info("held-out exact-answer accuracy %.3f after %.0f s", accuracy, time.monotonic() - started)
    return accuracy
