"""The run API's web glue (the logic is :mod:`.api`): faust's own aiohttp web server and
views, on the processor's event loop (web_in_thread off), so a handler reads the core's
state between two records, never during one. Only faust's production index ("/", a
liveness probe) is left of its built-in pages; its router, table, statistics, graph and
metrics pages are off.

Every path of :data:`.api.ROUTES` gets one view that hands every method to
:func:`.api.handle` (which answers 405 itself); a middleware gives aiohttp's own errors
(an unknown path, OPTIONS, a body over 1 MiB) the API's JSON error shape.

The token comes from TRAINGUARD_API_TOKEN, or from the file named by
TRAINGUARD_API_TOKEN_FILE (as the command secret does, schemas/auth.py); without one the
API does not start.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import faust
from aiohttp import web as aioweb
from faust.web import Request, Response, View

from ..schemas import Command
from . import api

log = logging.getLogger("trainguard.api")

TOKEN_ENV = "TRAINGUARD_API_TOKEN"
TOKEN_FILE_ENV = "TRAINGUARD_API_TOKEN_FILE"
_MIN_TOKEN_CHARS = 16
MAX_BODY_BYTES = 1 << 20
#: How long a POST waits for its command's delivery before answering 503.
PUBLISH_TIMEOUT_S = 10.0

Publish = Callable[[Command], Awaitable[None]]


class ApiTokenError(RuntimeError):
    pass


def load_api_token(env: dict[str, str] | None = None) -> str:
    """The API token from TRAINGUARD_API_TOKEN or the file in TRAINGUARD_API_TOKEN_FILE."""
    env = dict(os.environ) if env is None else env
    if value := env.get(TOKEN_ENV):
        token = value.strip()
    elif path := env.get(TOKEN_FILE_ENV):
        try:
            token = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiTokenError(f"{TOKEN_FILE_ENV}={path}: cannot read the API token file ({exc})") from exc
    else:
        raise ApiTokenError(
            f"the run API needs a token: set {TOKEN_ENV} or point {TOKEN_FILE_ENV} at a file "
            "(e.g. `trainguard secret init --path .trainguard/api-token`)"
        )
    if len(token) < _MIN_TOKEN_CHARS:
        raise ApiTokenError(f"the API token is shorter than {_MIN_TOKEN_CHARS} characters")
    return token


def _json(response: api.ApiResponse) -> aioweb.Response:
    return aioweb.json_response(response.body, status=response.status, headers=dict(response.headers))


@aioweb.middleware
async def json_errors(
    request: aioweb.Request, handler: Callable[[aioweb.Request], Awaitable[aioweb.StreamResponse]]
) -> aioweb.StreamResponse:
    """aiohttp's own errors (raised before or around a view) in the API's error shape."""
    try:
        return await handler(request)
    except aioweb.HTTPMethodNotAllowed:  # OPTIONS, or POST on faust's index
        return _json(api.method_not_allowed(request.method, request.path))
    except aioweb.HTTPNotFound:
        message = f"no such path: {request.path} (GET /openapi.json lists them)"
        return _json(api.error(404, "not_found", message))
    except aioweb.HTTPRequestEntityTooLarge:
        message = f"the body is larger than {MAX_BODY_BYTES} bytes"
        return _json(api.error(413, "too_large", message))
    except aioweb.HTTPException:
        raise
    except Exception:
        log.exception("run API: %s %s failed", request.method, request.path)
        return _json(api.error(500, "internal", "the request failed inside the processor; see its log"))


def web_options(port: int | None, host: str) -> dict[str, Any]:
    """faust.App settings: the web server off, or on `host:port` with only the API."""
    if port is None:
        return {"web_enabled": False}
    return {
        "web_enabled": True,
        "web_port": port,
        "web_bind": host,
        "web_host": host,
        "web_in_thread": False,  # one loop: a request never sees a record half folded
        "web_router_enabled": False,
        "web_tables_enabled": False,
        "web_stats_enabled": False,
        "web_graph_enabled": False,
        "web_metrics_enabled": False,
        "web_application_options": {"middlewares": [json_errors], "client_max_size": MAX_BODY_BYTES},
    }


def mount(app: faust.App, context: api.ApiContext, publish: Publish) -> None:
    """Register the API's views on `app` (before it starts)."""
    if len(context.token) < _MIN_TOKEN_CHARS:
        raise ApiTokenError("the run API needs a token of at least 16 characters")
    view = _view(context, publish)
    for path in dict.fromkeys(route.path for route in api.ROUTES if not route.builtin):
        app.page(path, name=f"trainguard-api:{path}")(type("RunApiView", (view,), {}))


def _view(context: api.ApiContext, publish: Publish) -> type[View]:
    async def serve(request: Request, method: str | None = None) -> Response:
        raw = request  # faust's aiohttp driver hands views the aiohttp request
        assert isinstance(raw, aioweb.Request)
        method = method or raw.method
        body = await raw.read()
        headers = {k: v for k, v in raw.headers.items()}
        request_id = uuid.uuid4().hex
        response = api.handle(context, api.ApiRequest.make(method, raw.path, headers, body, request_id))
        for command in response.commands:  # delivered before the client hears "accepted"
            try:
                await asyncio.wait_for(publish(command), PUBLISH_TIMEOUT_S)
            except Exception as exc:
                log.exception("run API: publishing %s %s failed", command.KIND, command.command_id)
                message = f"the {command.KIND} command could not be published to Kafka ({type(exc).__name__})"
                response = api.error(503, "unavailable", message)
                break
        return _json(response)

    class RunApiView(View):
        async def get(self, request: Request, **_: Any) -> Response:
            return await serve(request)  # GET, and HEAD (faust's View.head calls get)

        async def post(self, request: Request, **_: Any) -> Response:
            return await serve(request, "POST")

        async def put(self, request: Request, **_: Any) -> Response:
            return await serve(request, "PUT")

        async def patch(self, request: Request, **_: Any) -> Response:
            return await serve(request, "PATCH")

        async def delete(self, request: Request, **_: Any) -> Response:
            return await serve(request, "DELETE")

    return RunApiView
