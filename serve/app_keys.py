"""Typed keys of the application's shared state (aiohttp's `AppKey`, instead of string keys)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from jaxinfer.engine.async_engine import AsyncEngine
    from serve.engine_requests import Lifecycle
    from serve.http_metrics import ServerMetrics
    from serve.limits import RequestLimits

ENGINE: web.AppKey[AsyncEngine] = web.AppKey("engine")
SERVER_METRICS: web.AppKey[ServerMetrics] = web.AppKey("server_metrics")
MAX_WAITING: web.AppKey[int] = web.AppKey("max_waiting")              # --max-waiting
MAX_REQUEST_BYTES: web.AppKey[int] = web.AppKey("max_request_bytes")  # --max-request-bytes
SHUTDOWN_GRACE: web.AppKey[float] = web.AppKey("shutdown_grace")      # --shutdown-grace, seconds
OWNS_ENGINE: web.AppKey[bool] = web.AppKey("owns_engine")  # the app shuts the engine down
LIFECYCLE: web.AppKey[Lifecycle] = web.AppKey("lifecycle")
CREATED: web.AppKey[int] = web.AppKey("created")  # unix time, the models' `created`
LIMITS: web.AppKey[RequestLimits] = web.AppKey("limits")              # --max-stop-strings etc.
BODY_TIMEOUT: web.AppKey[float] = web.AppKey("body_timeout")          # --body-timeout, seconds
MAX_JSON_ITEMS: web.AppKey[int] = web.AppKey("max_json_items")  # the most values a valid body holds
