"""Who is calling: resolved once per request by the guard, from ``Authorization: Bearer <value>``.

- the admin token (``MEMVIT_ADMIN_TOKEN``, compared in constant time): ``admin``, every name;
- a key of the keys file (``MEMVIT_API_KEYS_FILE``, server/tenancy/keys.py): that key, the names it covers;
- no bearer value: ``anonymous``;
- a bearer value that matches nothing: ``unknown`` (the routes that look at credentials refuse it).

The guard stores the principal in ``scope["state"]`` (``request.state.principal``, ``deps.PrincipalDep``)
so that routes filter what a key may see without resolving it again.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import Scope

from memvit.memory_core import BASE_TASK

from ..settings import Settings
from ..tenancy.key_file import KeyFile
from ..tenancy.keys import ApiKey
from ..tenancy.policy import DEFAULT, Policy


class Kind(enum.Enum):
    ADMIN = "admin"
    KEY = "key"
    ANONYMOUS = "anonymous"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Principal:
    kind: Kind
    key: ApiKey | None = None

    @property
    def id(self) -> str:
        """What the log and the audit trail call it (a key's id, never the key)."""
        return self.key.id if self.key is not None else self.kind.value

    @property
    def sees_all(self) -> bool:
        """Not limited to some names: the admin, or a caller the read rule let through without a key."""
        return self.key is None

    def covers(self) -> str:
        """The names a key covers, for messages: "acme-*" or "acme-*, shared-*"."""
        return ", ".join(self.key.names) if self.key is not None else "*"

    def may_read(self, name: str) -> bool:
        return self.key is None or name == BASE_TASK or self.key.may_read(name)

    def may_write(self, name: str) -> bool:
        """Once the access rule let this principal manage adapters: may it change ``name``?"""
        return self.kind is not Kind.KEY or (self.key is not None and self.key.may_write(name))

    def visible(self, names: Iterable[str]) -> list[str]:
        """``names`` this principal may read, in their order."""
        return [n for n in names if self.may_read(n)]


ADMIN = Principal(Kind.ADMIN)
ANONYMOUS = Principal(Kind.ANONYMOUS)
UNKNOWN = Principal(Kind.UNKNOWN)


class Credentials:
    """The admin token and the keys file of one server: ``resolve`` turns a header into a principal."""

    def __init__(self, settings: Settings) -> None:
        token = settings.admin_token
        self.token = token.get_secret_value().encode() if token is not None else None
        self.keys = (
            KeyFile(settings.api_keys_file, reload_seconds=settings.api_keys_reload_seconds)
            if settings.api_keys_file is not None
            else None
        )

    def resolve(self, authorization: str | None) -> Principal:
        scheme, _, given = (authorization or "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return ANONYMOUS
        if self.token is not None and hmac.compare_digest(given.encode(), self.token):
            return ADMIN
        if self.keys is not None and (key := self.keys.ring().lookup(given)) is not None:
            return Principal(Kind.KEY, key)
        return UNKNOWN

    def policy(self, principal: Principal) -> Policy:
        """``principal``'s weight and limits: its key's, or the keys file's for ``admin`` and
        ``anonymous`` (none without a keys file)."""
        if principal.key is not None:
            return principal.key.policy
        return DEFAULT if self.keys is None else self.keys.ring().policy_of(principal.id)


def set_principal(scope: Scope, principal: Principal) -> None:
    scope.setdefault("state", {})["principal"] = principal


def check_credentials(settings: Settings) -> None:
    """For ``preflight``: the keys file reads (ValueError naming the setting otherwise), and a read key
    can be satisfied by someone."""
    if settings.api_keys_file is not None:
        try:
            KeyFile(settings.api_keys_file, reload_seconds=settings.api_keys_reload_seconds)
        except (OSError, ValueError) as exc:
            raise ValueError(f"MEMVIT_API_KEYS_FILE: {exc}") from None
    elif settings.require_read_key and settings.admin_token is None:
        raise ValueError(
            "MEMVIT_REQUIRE_READ_KEY=true needs MEMVIT_API_KEYS_FILE (or MEMVIT_ADMIN_TOKEN): "
            "no one could read"
        )
