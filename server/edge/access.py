"""Who may call a route: the rule behind each ``Access`` of the route table, on the headers alone.

The guard runs it before a byte of the body is read (FastAPI parses a multipart form before a route's
dependencies run, so a check in the route would come after the upload was spooled to disk). It is
the only place a request's credentials are checked; the principal it settles on (principal.py) goes
to the routes, which only filter by it.

- ``ADMIN`` (changing adapters): the admin token; a key with ``write``, for the names it covers (a
  name in the path is checked here; a bundle's name when the registry has parsed it); anyone only when
  anonymous admin is on, which it never is with a token or a keys file configured.
- ``READ`` (classifying, listing): anyone, unless ``MEMVIT_REQUIRE_READ_KEY``; a key reads only the
  names it covers (``base`` always), so a name in the path it does not cover is refused here, before
  anyone looks up whether it exists.
- ``ACCOUNT`` (usage): any key, for its own account; the admin (or anyone, where anyone may manage
  adapters) for every key's.
"""

from __future__ import annotations

from ..errors import AdminDisabledError, ForbiddenError, NotAuthenticatedError
from ..settings import Settings
from .principal import ANONYMOUS, Credentials, Kind, Principal
from .routes import Access, Route


def check_access(
    route: Route, settings: Settings, principal: Principal, name: str | None = None
) -> Principal:
    """The principal the route sees, or the ``ServiceError`` (401/403) that refuses this request.

    ``name``: the adapter named in the request's path, if its route has one."""
    if route.access is Access.ADMIN:
        check_manage(settings, principal, name)
    elif route.access is Access.READ:
        return check_read(settings, principal, name)
    elif route.access is Access.ACCOUNT:
        if principal.kind is not Kind.KEY:  # a key reads its own; anyone else must be the admin
            check_manage(settings, principal, None)
    elif principal.kind is Kind.UNKNOWN:  # a public route: credentials play no part
        return ANONYMOUS
    return principal


def check_admin(settings: Settings, authorization: str | None) -> None:
    """The admin rule for one ``Authorization`` header (no name: may this caller manage at all?)."""
    check_manage(settings, Credentials(settings).resolve(authorization), None)


def check_manage(settings: Settings, principal: Principal, name: str | None) -> None:
    """May ``principal`` change adapters (named ``name``, when the request names one)?"""
    if principal.kind is Kind.ADMIN:
        return
    if principal.kind is Kind.KEY:
        key = principal.key
        assert key is not None
        if not key.write:
            raise ForbiddenError(f"key {key.id!r} may not change adapters: it is read-only")
        if name is not None and not key.may_write(name):
            raise name_refused(principal, name, "change")
        return
    if settings.admin_token is None and settings.api_keys_file is None:
        if settings.allow_anonymous_admin:
            return
        raise AdminDisabledError(
            "adapter management is disabled: no admin token is configured. Set MEMVIT_ADMIN_TOKEN (or "
            "MEMVIT_API_KEYS_FILE) and send 'Authorization: Bearer <token>', or set "
            "MEMVIT_ALLOW_ANONYMOUS_ADMIN=true to let anyone who can reach this port add and delete adapters"
        )
    wanted = "admin token or API key" if settings.api_keys_file is not None else "admin token"
    if principal.kind is Kind.ANONYMOUS:
        raise NotAuthenticatedError(f"this endpoint needs 'Authorization: Bearer <{wanted}>'")
    raise ForbiddenError(f"the {wanted} is not valid")


def check_read(settings: Settings, principal: Principal, name: str | None) -> Principal:
    """May ``principal`` read (the adapter ``name``)? Returns the principal the route filters by."""
    keys_matter = settings.require_read_key or settings.api_keys_file is not None
    if principal.kind is Kind.UNKNOWN:
        if keys_matter:
            raise ForbiddenError("the API key is not valid")
        principal = ANONYMOUS  # no keys to match: a bearer value means nothing here, as before keys
    if principal.kind is Kind.ANONYMOUS and settings.require_read_key:
        raise NotAuthenticatedError(
            "this endpoint needs 'Authorization: Bearer <API key>' (MEMVIT_REQUIRE_READ_KEY is on)"
        )
    if name is not None and not principal.may_read(name):
        raise name_refused(principal, name, "read")
    return principal


def name_refused(principal: Principal, name: str | list[str], verb: str) -> ForbiddenError:
    """The 403 for a key asking for names it does not cover (never saying whether they exist)."""
    key = principal.key
    assert key is not None
    named = repr(name) if isinstance(name, str) else ", ".join(map(repr, name))
    allowed = key.read if verb == "read" else key.write
    why = f"it covers {principal.covers()}" if allowed else f"it may not {verb} any"
    return ForbiddenError(f"this key may not {verb} adapters named {named} ({why})")
