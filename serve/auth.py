"""API-key check (`--api-key`): `Authorization: Bearer <key>` on every route except the
unauthenticated probes, compared in constant time so response timing does not leak the key."""

from __future__ import annotations

import hmac

from aiohttp import web

from serve.errors import error_response

# Probes that orchestrators and Prometheus call without credentials, as in vLLM.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})


def make_auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.method == "OPTIONS" or request.path in OPEN_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, expected):
            return error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                  headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return auth_middleware
