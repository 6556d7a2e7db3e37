"""``memvit serve``: the HTTP API, settings from MEMVIT_* variables (with none, the embedded demo).

On SIGTERM uvicorn stops accepting, lets running requests finish for up to
``timeout_graceful_shutdown`` seconds (a queued batch included), then the app closes the batcher.
With ``MEMVIT_API_PROCESSES`` > 1 a supervisor runs the processes of a front end instead
(server/frontend/supervisor.py) and stops them all on SIGTERM.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .common import fail

if TYPE_CHECKING:
    from ..settings import Settings


def serve(
    host: Annotated[str | None, typer.Option(help="bind address (MEMVIT_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (MEMVIT_PORT)")] = None,
    model: Annotated[str | None, typer.Option(help="timm architecture (MEMVIT_MODEL)")] = None,
    weights: Annotated[Path | None, typer.Option(help="base weights (MEMVIT_WEIGHTS)")] = None,
    adapter_store: Annotated[
        str | None,
        typer.Option(help="adapter directory or s3://bucket/prefix (MEMVIT_ADAPTER_STORE)"),
    ] = None,
) -> None:
    """Serve the HTTP API. Settings come from MEMVIT_* variables; with none, the embedded demo."""
    import uvicorn
    from pydantic import ValidationError

    from ..http.app import create_app, preflight
    from ..http.timeouts import header_timeout_protocol
    from ..settings import Settings

    overrides = {
        "host": host,
        "port": port,
        "model": model,
        "weights": weights,
        "adapter_store": adapter_store,
    }
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        preflight(settings)
    except ValidationError as exc:
        problems = "; ".join(
            f"MEMVIT_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in exc.errors()
        )
        raise fail(ValueError(f"invalid settings: {problems}")) from None
    except (ValueError, OSError) as exc:
        raise fail(exc) from None
    logging.getLogger().setLevel(settings.log_level.upper())
    settings = loopback_admin_default(settings)
    if settings.front_end_mode != "single":
        from ..frontend.supervisor import serve_group

        logging.basicConfig(format="%(levelname)s:%(name)s: %(message)s")
        raise typer.Exit(serve_group(settings))
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(settings.header_timeout_seconds),
    )


def loopback_admin_default(settings: Settings) -> Settings:
    """``memvit serve`` on a loopback address with no admin token and no keys file leaves adapter
    management open to local clients (the laptop demo stays one command), saying so in one line; other
    web pages are still refused (server/edge/origin.py). Never for any other address (the image binds
    0.0.0.0), and never over an explicit MEMVIT_ALLOW_ANONYMOUS_ADMIN."""
    from ..edge.origin import is_loopback

    configured = settings.admin_token is not None or settings.api_keys_file is not None
    if configured or "allow_anonymous_admin" in settings.model_fields_set:
        return settings
    if not is_loopback(settings.host):  # a host name other than localhost may resolve to anything
        return settings
    logging.getLogger("memvit.server").warning(
        "no MEMVIT_ADMIN_TOKEN and bound to loopback %s: POST/DELETE /adapters are open to local clients "
        "(not to web pages of other sites; set MEMVIT_ADMIN_TOKEN or MEMVIT_API_KEYS_FILE, or "
        "MEMVIT_ALLOW_ANONYMOUS_ADMIN=false, to close them)",
        settings.host,
    )
    return settings.model_copy(update={"allow_anonymous_admin": True})
