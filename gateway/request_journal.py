"""Every finished chat request, once: its INFO log line and the dashboard's list of recent requests.

``ChatHandler`` calls ``ended`` exactly once per request that reached it, on every path
(finished, refused, failed, cancelled). The line carries the request id, placement and its
reason, prompt and completion tokens, TTFT and its breakdown (the same object the client
gets in ``x-epd-ttft-breakdown``; for a request admission refused on time, what it weighed:
``estimated_ttft_ms`` and the reported queue it holds, ``estimated_queue_ms``, ``backlog_ms``,
``overrun_ms`` against ``remaining_ms``) and the
outcome: a finish reason (``stop``, ``length``) or the failure reason of
``epd:request_failure_total`` (``refused``, ``deadline``, ``backend``, ``cancelled``,
``client_error``, ``internal``). With ``--log-format json`` its fields are the
line's top-level keys (``runtime/worker/log_format.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

log = logging.getLogger("epd.gateway.requests")

KEEP = 50   # requests the dashboard shows


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    outcome: str                    # "stop" | "length" | a failure reason
    status: int                     # the HTTP status the client got (200 for a stream that failed late)
    ended_unix: float = field(default_factory=time.time)
    placement: str = ""             # "" when it ended before placement
    placement_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    images: int = 0
    ttft_ms: float | None = None    # None: no first token
    breakdown: dict[str, float] = field(default_factory=dict)


class RequestJournal:
    """The last ``keep`` finished requests (newest last) and the one log line per request."""

    def __init__(self, keep: int = KEEP):
        self._recent: deque[RequestRecord] = deque(maxlen=keep)

    def ended(self, record: RequestRecord) -> None:
        self._recent.append(record)
        fields = {"event": "request_finished", **asdict(record)}
        fields.pop("ended_unix")
        ttft = "-" if record.ttft_ms is None else f"{record.ttft_ms:.1f}ms"
        log.info("request %s %s: %s/%s, %d+%d tokens, ttft %s", record.request_id, record.outcome,
                 record.placement or "-", record.placement_reason or "-", record.prompt_tokens,
                 record.completion_tokens, ttft, extra={"fields": fields})

    def recent(self) -> list[dict]:
        return [asdict(r) for r in self._recent]
