"""The one table of the edge: per route, who may call it, whether it changes state, its body cap, its
body deadline, and whether it is metered (runs images: the caller's limits apply).

Every route of the app has a row (``create_app`` refuses to build an app with a route the table
lacks: ``missing_routes``), so a new route cannot silently skip the guard. ``access`` and
``changes_state`` are explicit facts that checks key on: the access rules (server/edge/access.py),
and the checks that only concern state-changing requests (their origin: server/edge/origin.py; the
audit trail: server/tenancy/audit.py) select them here instead of listing paths again.

A request that matches no row (the router answers it 404 or 405 without reading its body) gets the
fallback: public, no state changed, no cap, the default deadline. HEAD is looked up as GET.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.routing import compile_path

from ..settings import Settings
from .body import MULTIPART_ALLOWANCE, BodyCap

try:
    from fastapi.routing import iter_route_contexts
except ImportError:  # FastAPI before included routers were kept whole: app.routes is already flat

    def iter_route_contexts(routes):  # type: ignore[no-redef]
        return iter(routes)


class Access(enum.Enum):
    """Who may call a route."""

    PUBLIC = "public"  # anyone who can reach the port
    READ = "read"  # reads adapters: anyone, or a key with MEMVIT_REQUIRE_READ_KEY; a key sees its own
    ADMIN = "admin"  # changes adapters: the token, a key with write for its names, or anonymous admin
    ACCOUNT = "account"  # a key's own account (its usage): any key; everyone's: the admin


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # the template, as the app declares it (and as metrics label it)
    access: Access
    changes_state: bool  # the request changes what the server serves (the adapter set)
    cap: BodyCap | None  # the whole body's cap; None: the route reads no body
    deadline: float  # seconds for the whole body, from the start of the request
    metered: bool = False  # it runs images through the model: the caller's limits apply (limits.py)
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Starlette's own template compiler: a row matches exactly the paths its route matches.
        object.__setattr__(self, "pattern", compile_path(self.path)[0])


class RouteTable:
    """The rows, looked up by a request's method and path (without any root path)."""

    def __init__(self, routes: Iterable[Route], default_deadline: float) -> None:
        self.routes = tuple(routes)
        self.default_deadline = default_deadline
        keys = [(r.method, r.path) for r in self.routes]
        if len(set(keys)) != len(keys):
            raise ValueError(f"the route table names a route twice: {keys}")

    def __iter__(self) -> Iterator[Route]:
        return iter(self.routes)

    def find(self, method: str, path: str) -> Route | None:
        """The row for this request, or None when no route takes it (the fallback applies)."""
        method = "GET" if method == "HEAD" else method
        # A literal path wins over a template that also matches it (/ui/samples over /ui/{name}).
        candidates = [r for r in self.routes if r.method == method and r.pattern.match(path)]
        return next((r for r in candidates if "{" not in r.path), candidates[0] if candidates else None)

    @staticmethod
    def name_in(route: Route, path: str) -> str | None:
        """The adapter ``{name}`` in ``path``, when ``route``'s template has one."""
        match = route.pattern.match(path)
        return match.groupdict().get("name") if match else None

    def fallback(self, method: str, path: str) -> Route:
        """What a request no route takes gets (see the module's doc)."""
        return Route(method, path, Access.PUBLIC, False, None, self.default_deadline)


def route_table(settings: Settings) -> RouteTable:
    """Every route of the app, with the limits ``settings`` set."""
    deadline = settings.body_timeout_seconds
    bundle, images, per_image = (
        settings.max_bundle_bytes,
        settings.max_images_per_request,
        settings.max_image_bytes,
    )
    bundle_cap = BodyCap(bundle + MULTIPART_ALLOWANCE, f"a bundle over the {bundle}-byte upload limit")
    images_cap = BodyCap(
        images * per_image + MULTIPART_ALLOWANCE, f"at most {images} images of at most {per_image} bytes each"
    )

    # Encoded images (BYTES) or preprocessed pixels (FP32, binary: 0.6 MB per 224x224 image), as
    # tensor data after a JSON header.
    infer_cap = BodyCap(
        images * per_image + MULTIPART_ALLOWANCE, f"at most {images} images of at most {per_image} bytes each"
    )

    # Every route has the same body deadline today; a row that needs its own would set it here.
    def row(
        method: str,
        path: str,
        access: Access = Access.PUBLIC,
        *,
        changes_state: bool = False,
        cap: BodyCap | None = None,
        metered: bool = False,
    ) -> Route:
        return Route(method, path, access, changes_state, cap, deadline, metered)

    return RouteTable(
        (
            # Classifying reads the adapter set and changes nothing, even though it is a POST.
            row("POST", "/classify", Access.READ, cap=images_cap, metered=True),
            row("GET", "/adapters", Access.READ),
            row("GET", "/adapters/{name}", Access.READ),
            row("POST", "/adapters", Access.ADMIN, changes_state=True, cap=bundle_cap),
            row("DELETE", "/adapters/{name}", Access.ADMIN, changes_state=True),
            # The Open Inference Protocol (routers/oip.py): infer reads adapters as /classify does.
            row("GET", "/v2"),
            row("GET", "/v2/health/live"),
            row("GET", "/v2/health/ready"),
            row(
                "POST",
                "/v2/repository/index",
                Access.READ,
                cap=BodyCap(MULTIPART_ALLOWANCE, "an index request has no body"),
            ),
            row("GET", "/v2/models/{model}", Access.READ),
            row("GET", "/v2/models/{model}/ready", Access.READ),
            row("POST", "/v2/models/{model}/infer", Access.READ, cap=infer_cap, metered=True),
            row("GET", "/usage", Access.ACCOUNT),
            row("GET", "/healthz"),
            row("GET", "/readyz"),
            row("GET", "/metrics"),
            row("GET", "/"),  # the page (routers/ui.py)
            row("GET", "/ui/samples"),
            row("GET", "/ui/samples/{name}"),
            row("GET", "/ui/{name}"),
            row("GET", "/openapi.json"),  # FastAPI's own document and its viewers
            row("GET", "/docs"),
            row("GET", "/docs/oauth2-redirect"),
            row("GET", "/redoc"),
        ),
        default_deadline=deadline,
    )


def app_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path template) of every route ``app`` serves, included routers' with their prefix."""
    found = set()
    for route in iter_route_contexts(app.routes):
        for method in getattr(route, "methods", None) or ():
            found.add(("GET" if method == "HEAD" else method, route.path))
    return found


def missing_routes(app: FastAPI, table: RouteTable) -> list[str]:
    """The app's routes that have no row in ``table``, as "METHOD /path"."""
    rows = {(r.method, r.path) for r in table}
    return sorted(f"{method} {path}" for method, path in app_routes(app) - rows)
