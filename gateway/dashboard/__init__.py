"""``/dashboard``: the operator's live page, served by the gateway itself (no build step, no CDN).

=========================  ==================================================================
``GET /dashboard``         the page shell (``static/index.html``); open, it holds no data
``GET /dashboard/static/`` its script and style sheet, from this package
``GET /dashboard/data``    the JSON the page polls every 1.5 s (``data.py``); with API keys
                           it needs a key, like ``/status`` (``gateway.auth.needs_key``)
=========================  ==================================================================

With keys on, the page asks for one once and keeps it in the browser's local storage.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

from ..chat_backend import ChatBackend
from ..errors import ApiError
from ..http_metrics import HttpMetrics
from ..live_window import CounterHistory
from ..request_journal import RequestJournal
from ..settings import GatewaySettings
from .data import dashboard_data

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def install_dashboard(app: FastAPI, settings: GatewaySettings, backend: ChatBackend, metrics: HttpMetrics,
                      history: CounterHistory, journal: RequestJournal) -> None:
    @app.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:
            raise ApiError(404, f"no dashboard asset {name!r}", "invalid_request_error", None, "not_found")
        return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/data", summary="everything /dashboard draws, as JSON")
    async def data() -> dict:
        return dashboard_data(settings, backend.status(), metrics, history, journal)
