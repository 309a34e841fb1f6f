"""What the policy reads: one request's shape and a snapshot of every stage's load.

Built per decision by ``runtime.policy.worker_stats.stage_loads`` (the gateway and the
simulator alike) or, in tests and the worked example, by hand. The dataclasses are plain
(not frozen: construction is on every request's path) but are snapshots: the policy
never changes or keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestShape:
    """What placement needs to know about one request.

    ``prompt_tokens`` counts every token prefill processes (image tokens included).
    ``image_tokens`` is the images' placeholder tokens in all, the unit an encode is priced
    in (the vision tower's work grows with an image's patches, and so with its tokens: a
    1024x1024 Qwen-VL image is ~20x a 224x224 one); ``image_tokens_cached``, those of the
    images the encoder cache holds. Every image has at least one token.
    """

    prompt_tokens: int
    max_tokens: int
    n_images: int = 0
    n_images_cached: int = 0
    choices: int = 1          # n: completions sharing the prompt's KV (each its own output blocks)
    image_tokens: int = 0
    image_tokens_cached: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.choices < 1:
            raise ValueError(f"choices must be >= 1, got {self.choices}")
        if not 0 <= self.n_images_cached <= self.n_images:
            raise ValueError(f"need 0 <= n_images_cached <= n_images, got {self.n_images_cached}/{self.n_images}")
        if self.image_tokens < self.n_images or (self.image_tokens and not self.n_images):
            raise ValueError(f"{self.n_images} images need image_tokens of at least one each, got {self.image_tokens}")
        if not 0 <= self.image_tokens_cached <= self.image_tokens:
            raise ValueError(f"need 0 <= image_tokens_cached <= image_tokens, got {self.image_tokens_cached}/{self.image_tokens}")

    @property
    def new_image_tokens(self) -> int:
        """The placeholder tokens of the images to encode (not in the encoder cache)."""
        return self.image_tokens - self.image_tokens_cached

    def images_after(self, skipped: int) -> RequestShape:
        """This shape with its first ``skipped`` images left out of the encode (a decode worker's cached
        prefix holds them). The images are not told apart, so the rest keep their share of the tokens
        and of the cache hits."""
        rest = self.n_images - skipped
        if rest <= 0:
            return RequestShape(self.prompt_tokens, self.max_tokens, choices=self.choices)
        tokens = self.image_tokens * rest // self.n_images
        return RequestShape(self.prompt_tokens, self.max_tokens, rest, min(self.n_images_cached, rest), self.choices,
                            tokens, min(self.image_tokens_cached, tokens))


@dataclass(slots=True)
class EncoderLoad:
    """The encoder pool: wait until the least-loaded encoder could start."""

    queue_wait_ms: float = 0.0


@dataclass(slots=True)
class PrefillWorkerLoad:
    address: str
    queue_wait_ms: float = 0.0  # until this worker could start a new prompt
    # decode workers whose cores this one computes on, each with how busy those cores are (0-1):
    # a prompt here competes with that worker's queued work (runtime/policy/placement_policy.py)
    shared_cores: tuple[tuple[str, float], ...] = ()
    # decode workers known to compute on other CPUs (both report their cores, none shared): a prompt
    # here delays none of their running sequences, which a colocated one would
    apart_from: tuple[str, ...] = ()


@dataclass(slots=True)
class DecodeWorkerLoad:
    """One decode worker. ``running_seqs`` are the neighbours a local prefill would stall."""

    address: str
    running_seqs: int = 0
    free_slots: int = 1  # batch slots neither running, reserved nor promised to queued requests
    # (a request of n choices needs n of them; below that it waits ``slot_wait_ms``)
    free_blocks: int | None = None  # free KV blocks; None: not reported (no block check)
    block_size: int = 16  # tokens per KV block
    queue_wait_ms: float = 0.0  # local prefill work already queued on this worker
    slot_wait_ms: float = 0.0  # until enough slots free, when free_slots < the request's choices
    accepts_local_prefill: bool = True  # False: a pure decode worker (no colocated option)
    cached_prefix_tokens: int = 0  # of this request's prompt, cached KV here (< prompt_tokens)
    cached_images: int = 0  # of this request's images, wholly inside that prefix (no encode when colocated here)
    ring_groups: int = 0  # windowed pool: rings per sequence (sliding-window layers; 0: dense)
    ring_blocks: int = 0  # ... and the most blocks one ring holds

    def __post_init__(self) -> None:
        if self.cached_prefix_tokens < 0 or self.cached_images < 0:
            raise ValueError(f"negative prefix-cache count in decode load for {self.address}")
        if self.running_seqs < 0 or self.block_size < 1:
            raise ValueError(f"bad decode load for {self.address}: running_seqs >= 0 and block_size >= 1")
        if self.queue_wait_ms < 0 or self.slot_wait_ms < 0:
            raise ValueError(f"negative wait in decode load for {self.address}")


@dataclass(slots=True)
class LinkLoad:
    """The KV link. A new transfer waits for ``queued_bytes`` (FIFO, ahead of it) and
    shares bandwidth with ``active_transfers`` that still have ``inflight_bytes`` to move."""

    active_transfers: int = 0
    inflight_bytes: float = 0.0
    queued_bytes: float = 0.0


@dataclass(slots=True)
class StageLoads:
    """Snapshot of every stage. ``encoder`` is None when no encoder reports (nothing to wait for)."""

    decode: tuple[DecodeWorkerLoad, ...]
    prefill: tuple[PrefillWorkerLoad, ...] = ()
    link: LinkLoad = field(default_factory=LinkLoad)
    encoder: EncoderLoad | None = None


# The shortest span a first-token rate is taken over (gateway and simulator alike): a burst's
# first tokens come within a few steps, and dividing 8 of them by a whole second judged the demo
# model's pipeline at a third of what it did (10/s against ~35/s) and refused most of a load
# whose admitted requests met their deadline with room to spare.
MIN_RATE_SPAN_S = 0.25

# A queued colocated prompt's first-token deadline is at risk when it is nearer than this many times
# the queued prompts' remaining prefill time (the decode worker's ``decode_svc/prefill_order.py`` and
# the simulator's decode workers alike): beside running decodes a step's prompt tokens take about
# as long as its decodes (the step budget), so draining the queue takes about twice its compute.
PREFILL_AT_RISK_FACTOR = 2.0


@dataclass(slots=True)
class Pressure:
    """The pipeline as seen from outside every worker (Little's law), for admission.

    ``waiting``: requests admitted and still without a first token; ``first_token_rate_per_s``:
    the rate first tokens come out (None: too few seen to trust); ``overrun_ms``: how much
    later than estimated recent first tokens came (a high quantile, >= 0). The gateway keeps
    this state (``gateway.pressure``), the simulator its own (``sim.pressure``); both pass it
    in as data.
    """

    waiting: int = 0
    first_token_rate_per_s: float | None = None
    overrun_ms: float = 0.0

    def margin_ms(self) -> float:
        """The misprediction margin admission adds: ``overrun_ms`` while anything waits, else 0."""
        return self.overrun_ms if self.waiting > 0 else 0.0

    def backlog_priced(self) -> bool:
        """Whether ``backlog_ms`` prices the queue: nothing waits, or a rate is trusted. A TTFT
        predicted without it (a burst at start-up) is late by the queue it left out, which is
        no misprediction of the model to learn a margin from."""
        return self.waiting <= 0 or self.first_token_rate_per_s is not None

    def backlog_ms(self) -> float:
        """Expected queueing before a new request's first token: ``waiting / rate`` (0 without a rate)."""
        rate = self.first_token_rate_per_s
        if self.waiting <= 0 or not rate:
            return 0.0
        return 1000.0 * self.waiting / rate
