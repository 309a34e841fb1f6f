"""What the client measured for one request (one row of ``--dump-requests``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Status of a request that got no HTTP response (connect error, timeout,
# a broken stream or an error event inside a 200 stream).
ERROR = "error"


@dataclass(slots=True)
class RequestRecord:
    index: int
    image_index: int
    long: bool
    answer: str  # the expected answer, "a <colour> <shape>"
    start_s: float = 0.0  # when it was sent, seconds after the benchmark started
    status: int | str = ERROR  # HTTP status, or ERROR
    ok: bool = False  # status 200 and the stream ended cleanly
    ttft_s: float | None = None  # send -> first chunk carrying content
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2e_s: float | None = None  # send -> end of stream
    output_tokens: int = 0  # usage.completion_tokens, else the number of content chunks
    text: str = ""
    ttft_breakdown: str | None = None  # raw x-epd-ttft-breakdown response header
    error: str | None = None  # error body or exception text
    retries: int = 0  # times it was sent again after a retryable refusal (``client.send_chat``)

    @property
    def correct(self) -> bool:
        return self.ok and self.text.strip().lower() == self.answer

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
