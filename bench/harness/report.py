"""How the scripts report: numbers as text, ratios, markdown tables, the results file's header."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return new / old


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def results_header(benchmark: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """``benchmark``, ``started`` (local time) and the ``command`` that ran (``python -m bench.NAME ...``)."""
    args = argv if argv is not None else sys.argv[1:]
    return {"benchmark": benchmark, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "command": f"python -m bench.{benchmark} " + " ".join(args)}


def settings_json(settings: dict[str, Any]) -> dict[str, Any]:
    """Parsed arguments as JSON values (paths as text)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items()}


def write_json(path: Path, payload: Any, indent: int = 1, allow_nan: bool = False) -> None:
    """The results file (its folder made when missing), with a final newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, allow_nan=allow_nan) + "\n")


def finish_results(path: Path, payload: dict[str, Any], indent: int = 1, allow_nan: bool = False) -> None:
    """Stamp the host's load average at the end (``payload["host"]["load_avg_end"]``) and write the file."""
    payload["host"]["load_avg_end"] = list(os.getloadavg())
    write_json(path, payload, indent, allow_nan)
