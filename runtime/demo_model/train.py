"""Seeded training of the demo VLM on synthetic shapes.

Two phases, both on CPU (30 minutes on 2 cores shared with other work; tests use the committed
checkpoint and never train):
1. warm-up: the vision tower learns the 12-way colour x shape classification
   (shape is slow to learn through the language model alone);
2. the whole VLM learns to answer "a <colour> <shape>" after a question, and the
   same answer as JSON or as a ``report_shape`` tool call (``tasks``): each step
   is one task's batch (so a short prompt is never padded to a tool prompt's
   length), plain three steps in five, JSON and tool one each.
The plain answer must reach >= 95% exact answers on 200 held-out images, else
training fails loudly rather than shipping a weak model; the JSON and tool-call
answers' exact rates are logged.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlavaForConditionalGeneration, LlavaProcessor

from . import tasks
from .shapes import QUESTIONS, SHAPES, COLOURS, ShapeSample, draw_shape
from .tasks import Task

log = logging.getLogger("epd.demo_model")

REQUIRED_ACCURACY = 0.95


@dataclass(slots=True)
class TrainPlan:
    seed: int = 0
    train_images: int = 8000
    eval_images: int = 200
    warmup_steps: int = 600
    vlm_steps: int = 1500
    batch_size: int = 32
    tool_batch_size: int = 8    # tool prompts are ~20x longer
    lr: float = 2e-3


_SCHEDULE = (Task.PLAIN, Task.JSON, Task.PLAIN, Task.TOOL, Task.PLAIN)


def _prompt(processor: LlavaProcessor, task: Task, question: str) -> str:
    return processor.apply_chat_template(tasks.messages(task, question), tools=tasks.tools(task),
                                         add_generation_prompt=True)


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


def _vlm_batch(processor: LlavaProcessor, task: Task, samples: list[ShapeSample], rng: random.Random) -> dict[str, torch.Tensor]:
    tok = processor.tokenizer
    prompts = [_prompt(processor, task, rng.choice(QUESTIONS)) for _ in samples]
    enc = processor(images=[s.image for s in samples], text=prompts, return_tensors="pt", padding=True)
    # Append the task's answer and <|end|> after each prompt; loss on those tokens only.
    rows, label_rows = [], []
    for i, s in enumerate(samples):
        prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
        answer_ids = tok(tasks.answer(task, s.colour, s.shape) + tok.eos_token, add_special_tokens=False)["input_ids"]
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
def evaluate(model: LlavaForConditionalGeneration, processor: LlavaProcessor, samples: list[ShapeSample],
             task: Task = Task.PLAIN) -> float:
    """Exact-answer accuracy of greedy ``generate()`` on ``samples`` for ``task``."""
    model.eval()
    correct = 0
    prompt = _prompt(processor, task, QUESTIONS[0])
    tok = processor.tokenizer
    for s in samples:
        enc = processor(images=[s.image], text=prompt, return_tensors="pt")
        expected = tasks.answer(task, s.colour, s.shape)
        budget = len(tok(expected, add_special_tokens=False)["input_ids"]) + 2
        out = model.generate(**enc, max_new_tokens=budget, do_sample=False)
        text = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += text.strip() == expected
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
        task = _SCHEDULE[step % len(_SCHEDULE)]
        size = plan.tool_batch_size if task is Task.TOOL else plan.batch_size
        batch = _vlm_batch(processor, task, rng.sample(train_set, size), rng)
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0:
            log.info("vlm step %d loss %.3f", step, loss.item())

    accuracy = evaluate(model, processor, eval_set)
    formats = {t.value: evaluate(model, processor, eval_set[:50], t) for t in (Task.JSON, Task.TOOL)}
    log.info("held-out exact-answer accuracy %.3f (json %.2f, tool call %.2f on 50) after %.0f s",
             accuracy, formats["json"], formats["tool"], time.monotonic() - started)
    return accuracy
