"""The page at ``/``: a small client of the public API (server/static/), and the demo's sample images.

Not part of the API (left out of the OpenAPI document): the page only calls /classify and /adapters
like any other client. Files are served from fixed lists, never from a path the request names, and
the page's Content-Security-Policy lets it load nothing from anywhere but this server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException

from ..demo import SAMPLES_DIR
from ..http.deps import SettingsDep

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob: data:",  # previews of the chosen files are blob: URLs
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
# Cheap to revalidate (ETag / Last-Modified), and never stale after an upgrade.
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

router = APIRouter(include_in_schema=False)


def demo_samples() -> list[str]:
    """File names of the demo's sample images, in name order."""
    return sorted(p.name for p in SAMPLES_DIR.glob("*.png"))


@router.get("/")
def page() -> FileResponse:
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type="text/html; charset=utf-8",
        headers={**HEADERS, "Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer"},
    )


@router.get("/ui/samples")
def samples(settings: SettingsDep) -> dict[str, list[str]]:
    """The sample images the page offers: the demo's, and only while the demo is served."""
    return {"samples": demo_samples() if settings.uses_demo else []}


@router.get("/ui/samples/{name}")
def sample(name: str, settings: SettingsDep) -> FileResponse:
    if not settings.uses_demo or name not in demo_samples():
        raise HTTPException(404, f"no sample {name!r}")
    return FileResponse(SAMPLES_DIR / name, media_type="image/png", headers=HEADERS)


@router.get("/ui/{name}")
def asset(name: Annotated[str, PathParam(max_length=64)]) -> FileResponse:
    if name not in ASSETS:
        raise HTTPException(404, f"no file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=HEADERS)
