"""The run API's OpenAPI 3.1 document, built from its routes and their pydantic models
(processors/api.py serves it at GET /openapi.json)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .api_models import ApiError

_ERROR_TEXT = {
    400: "Malformed JSON or header",
    401: "Missing or wrong token",
    404: "Unknown run",
    405: "Method not allowed",
    409: "Conflicts with the run's state",
    422: "Invalid fields (each named, with the reason)",
    503: "The command could not be published",
}
_REF = "#/components/schemas/{model}"


class OpenApiRoute(Protocol):
    """What the document reads of a route (processors/api.py: Route)."""

    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def operation(self) -> str: ...
    @property
    def summary(self) -> str: ...
    @property
    def response(self) -> type[BaseModel] | None: ...
    @property
    def status(self) -> int: ...
    @property
    def auth(self) -> bool: ...
    @property
    def request(self) -> type[BaseModel] | None: ...
    @property
    def body_required(self) -> bool: ...
    @property
    def idempotent_key(self) -> bool: ...
    @property
    def errors(self) -> tuple[int, ...]: ...


def build_openapi(
    routes: Sequence[OpenApiRoute], version: str, idempotency_key_pattern: str
) -> dict[str, Any]:
    """OpenAPI 3.1 from the routes and their pydantic models, so it cannot drift."""
    inputs = [r.request for r in routes if r.request is not None]
    outputs = [r.response for r in routes if r.response is not None] + [ApiError]
    pairs: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        *((m, "validation") for m in inputs),
        *((m, "serialization") for m in outputs),
    ]
    refs, schemas = models_json_schema(pairs, ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {"operationId": route.operation, "summary": route.summary}
        operation["security"] = [{"bearerAuth": []}] if route.auth else []
        parameters = [
            {"name": name.strip("{}"), "in": "path", "required": True, "schema": {"type": "string"}}
            for name in route.path.split("/")
            if name.startswith("{")
        ]
        if route.idempotent_key:
            parameters.append(
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "description": "A retried request with the same key acts once (same id).",
                    "schema": {"type": "string", "pattern": idempotency_key_pattern},
                }
            )
        if parameters:
            operation["parameters"] = parameters
        if route.request is not None:
            operation["requestBody"] = {
                "required": route.body_required,
                "content": {"application/json": {"schema": refs[(route.request, "validation")]}},
            }
        body = refs[(route.response, "serialization")] if route.response is not None else {"type": "object"}
        responses: dict[str, Any] = {
            str(route.status): {
                "description": route.summary,
                "content": {"application/json": {"schema": body}},
            }
        }
        error_body = {"application/json": {"schema": refs[(ApiError, "serialization")]}}
        for status in route.errors:
            responses[str(status)] = {"description": _ERROR_TEXT[status], "content": error_body}
        operation["responses"] = responses
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "trainguard run API",
            "version": version,
            "description": "Served by the processor from its live state (seed §3).",
        },
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }
