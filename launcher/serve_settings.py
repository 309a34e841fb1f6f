"""Settings only ``epd serve`` reads, typed, from ``EPD_*`` variables (overridable by its flags).

The workers' and the gateway's own settings (``runtime.worker.settings.WorkerSettings``,
``gateway.settings.GatewaySettings``) give serve's other defaults, so a variable means
the same to ``epd serve`` as to the process it configures.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore", env_ignore_empty=True)

    # supervision: a child that exits on its own is restarted after restart_backoff_s, doubling per
    # further exit within restart_window_s (at most restart_max_backoff_s); restart_limit exits
    # within the window and serve gives up on it
    restart_backoff_s: float = Field(default=1.0, ge=0, description="serve: wait before restarting a child that exited, seconds (doubles per exit in the window)")
    restart_max_backoff_s: float = Field(default=30.0, ge=0, description="serve: longest wait before a restart, seconds")
    restart_limit: int = Field(default=5, ge=1, description="serve: exits within the window after which serve gives up on a child")
    restart_window_s: float = Field(default=60.0, gt=0, description="serve: the window restart_limit counts exits in, seconds")
    cpu_bind: Literal["auto", "reserve", "none"] = Field(default="auto", description="serve: `auto` binds each model worker on the CPU device to cores of its own while enough are left (launcher/cpu_layout.py); `reserve` runs each decode worker's model thread on cores of its own and everything else on the last core; `none` binds nothing")
