"""vLLM's run-time LoRA endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name", "lora_int_id"?}, answered "Success: ..." as plain text.

Both are refused (400) unless the server runs with --allow-runtime-lora-updating (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), since they read server-side paths a client names. A bad adapter
(missing file, a path the OS refuses, rank over --max-lora-rank, wrong shapes, NaN or infinite
weights, a scaling out of bounds, unsupported target modules or options, a config nested too deep,
a regex target_modules that does not finish matching in time) or a bad name (not printable, too
long) gets a 400 naming the field and changes nothing; unloading an unknown name is a 404. Every
check runs before anything is registered, and the reply repeats only a checked name.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from jaxinfer.model.lora.peft import check_lora_name
from jaxinfer.sampling_params import short_repr
from serve.app_keys import ALLOW_LORA_UPDATES, ENGINE
from serve.errors import APIError, bad_request
from serve.protocol import read_json_body


def add_lora_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they "
                             "read adapter directories the client names on the server's disk)")


def _check_allowed(request: web.Request) -> None:
    if not request.app[ALLOW_LORA_UPDATES]:
        raise APIError(400, "run-time LoRA updating is off: start the server with "
                            "--allow-runtime-lora-updating")


def _string(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string", name)
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    _check_allowed(request)
    body = await read_json_body(request)
    name, path = check_lora_name(body.get("lora_name")), _string(body, "lora_path")
    await request.app[ENGINE].load_lora_adapter(name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    _check_allowed(request)
    body = await read_json_body(request)
    name = check_lora_name(body.get("lora_name"))
    engine = request.app[ENGINE]
    lora = engine.lora_requests.get(name)
    if lora is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
    lora_id = body.get("lora_int_id")
    if lora_id is not None and lora_id != lora.lora_int_id:
        raise bad_request(f"lora_int_id {short_repr(lora_id)} is not adapter '{name}''s "
                          f"({lora.lora_int_id})", "lora_int_id")
    await engine.unload_lora_adapter(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
