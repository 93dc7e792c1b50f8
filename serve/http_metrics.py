"""GET /metrics: the engine's Prometheus registry (requests, KV cache, latencies) plus the server's
own per-route request counter, in Prometheus text format."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from serve.app_keys import ENGINE

# nginx's code for "client closed the connection before the response was complete".
CLIENT_CLOSED = 499


class ServerMetrics:
    """Per-app (not module-level) so that several servers in one process, as in tests, stay apart."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "jaxinfer:http_requests", "HTTP requests by route, method and status code",
            ["model_name", "handler", "method", "status"], registry=self.registry)
        self.model_name = model_name

    def count(self, request: web.Request, status: int) -> None:
        resource = request.match_info.route.resource
        handler = resource.canonical if resource is not None else "unmatched"
        self.http_requests.labels(self.model_name, handler, request.method, str(status)).inc()


SERVER_METRICS: web.AppKey[ServerMetrics] = web.AppKey("server_metrics")


def make_metrics_middleware(metrics: ServerMetrics):
    @web.middleware
    async def metrics_middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            metrics.count(request, CLIENT_CLOSED)
            raise
        except web.HTTPException as exc:  # only when no error middleware converted it
            metrics.count(request, exc.status)
            raise
        metrics.count(request, response.status)
        return response

    return metrics_middleware


async def get_metrics(request: web.Request) -> web.Response:
    body = await request.app[ENGINE].metrics_text()  # (the engine-core process's, maybe)
    body += generate_latest(request.app[SERVER_METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
