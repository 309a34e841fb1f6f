"""How every epd process writes its log: ``text`` (default) or ``json`` (``--log-format json``).

One formatter per process, set once at start-up by ``configure_logging``. A record may
carry structured fields as ``extra={"fields": {...}}`` (the gateway's per-request line,
``gateway/request_journal.py``): in JSON they are top-level keys of the line's object; in
text they follow the message as ``key=value``. A JSON line is one object per line with
``ts`` (Unix seconds), ``level``, ``logger``, ``msg`` and, for an exception, ``exc``.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def _fields(record: logging.LogRecord) -> dict:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; structured ``fields`` merged in at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                      "msg": record.getMessage()}
        for key, value in _fields(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """The classic line, structured ``fields`` appended as ``key=value`` (dicts as compact JSON)."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _fields(record)
        if not fields:
            return text
        extra = " ".join(f"{k}={json.dumps(v, default=str, separators=(',', ':')) if isinstance(v, (dict, list)) else v}"
                         for k, v in fields.items())
        return f"{text} {extra}"


def configure_logging(fmt: LogFormat = "text", level: int = logging.INFO) -> None:
    """The root logger's one handler, on stderr, in ``fmt``; replaces any handler set before."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
