"""Typed keys of the application's shared state (aiohttp's `AppKey`, instead of string keys).

Keys whose value is a type defined in serve/ live beside that type (`engine_requests.LIFECYCLE`,
`http_metrics.SERVER_METRICS`), so this module imports nothing from serve/ and every module may
import it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from jaxinfer.frontends.async_engine import AsyncEngine

ENGINE: web.AppKey[AsyncEngine] = web.AppKey("engine")
MAX_WAITING: web.AppKey[int] = web.AppKey("max_waiting")              # --max-waiting
MAX_REQUEST_BYTES: web.AppKey[int] = web.AppKey("max_request_bytes")  # --max-request-bytes
SHUTDOWN_GRACE: web.AppKey[float] = web.AppKey("shutdown_grace")      # --shutdown-grace, seconds
OWNS_ENGINE: web.AppKey[bool] = web.AppKey("owns_engine")  # the app shuts the engine down
CREATED: web.AppKey[int] = web.AppKey("created")  # unix time, the models' `created`
BODY_TIMEOUT: web.AppKey[float] = web.AppKey("body_timeout")          # --body-timeout, seconds
ALLOW_LORA_UPDATES: web.AppKey[bool] = web.AppKey("allow_lora_updates")  # --allow-runtime-lora-updating
