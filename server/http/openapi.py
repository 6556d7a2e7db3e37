"""The OpenAPI document says what the service really answers: every status, with the real error body.

Routes declare their error statuses with ``errors(...)``; every error body is ``ErrorResponse``
(``{"error": {"type", "message", "field"}}``), including the 422 FastAPI would otherwise describe as
its own ``HTTPValidationError``. ``customise`` adds what only the settings know (how many images one
request may carry), and the 400 of the Host check, which every route can answer. The schemathesis
run in tests/server/http/test_openapi.py holds the document to it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ..settings import Settings
from .schemas import ErrorResponse, ProtocolErrorResponse

DESCRIPTIONS = {
    400: "malformed request: an empty or broken image, an unreadable multipart body, a Host header "
    "this server does not answer to (`MEMVIT_ALLOWED_HOSTS`), or no `tasks` while the registry holds "
    "more adapters than one request may ask for",
    401: "no `Authorization: Bearer <admin token or API key>` header where one is needed "
    "(management; reads with `MEMVIT_REQUIRE_READ_KEY`)",
    403: "the token or key is not valid or does not cover the adapter named, another site's page sent "
    "a change, or management is disabled (no token configured)",
    404: "no such adapter",
    408: "the request's body did not arrive in time",
    409: "conflicts with the registry: the name is taken, the parent is missing, or adapters extend it",
    413: "over a size cap: the request body, an image, a bundle, the number of images (the server's, or "
    "the key's largest request), or more adapters than one request may ask for or this server can hold "
    "resident at once",
    415: "not multipart/form-data, or a file that is not an image in an accepted format",
    422: "a parameter, bundle or task name that fails validation, or an adapter that cannot be served "
    "here (the message names the field)",
    429: "the key is over one of its limits (images per second, requests in flight); Retry-After says "
    "when to try again",
    503: "not ready yet, overloaded or every resident adapter in use (see Retry-After), or the adapter "
    "store is unavailable (an adapter could not be loaded)",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: each status with the service's error body and what it means."""
    return {code: {"model": ErrorResponse, "description": DESCRIPTIONS[code]} for code in codes}


def protocol_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``errors`` for the Open Inference Protocol's routes, whose error body is ``{"error": "<message>"}``."""
    return {code: {"model": ProtocolErrorResponse, "description": DESCRIPTIONS[code]} for code in codes}


def customise(app: FastAPI, settings: Settings) -> None:
    """Build the document once, with the settings' limits written into it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _limit_images(schema, settings.max_images_per_request)
            _host_refusals(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _limit_images(schema: dict[str, Any], max_images: int) -> None:
    """``image`` on /classify: at least one, at most ``max_images`` (the handler answers 413 above)."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        image = component.get("properties", {}).get("image")
        if image is not None and image.get("type") == "array":
            image.update(minItems=1, maxItems=max_images)


def _host_refusals(schema: dict[str, Any]) -> None:
    """Every route can answer 400 to a Host it does not answer to (server/edge/origin.py)."""
    for path, operations in schema.get("paths", {}).items():
        model = "ProtocolErrorResponse" if path == "/v2" or path.startswith("/v2/") else "ErrorResponse"
        body = {"$ref": f"#/components/schemas/{model}"}
        for operation in operations.values():
            operation.setdefault("responses", {}).setdefault(
                "400", {"description": DESCRIPTIONS[400], "content": {"application/json": {"schema": body}}}
            )
