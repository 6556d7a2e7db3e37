"""``memvit keys``: the tenant keys file (server/tenancy/keys.py) that ``MEMVIT_API_KEYS_FILE`` names.

memvit keys add acme --names 'acme-*' --write     # prints the new key once; only its sha256 is kept
memvit keys list                                   # id, names, read, write, created, weight, limits
memvit keys revoke acme                            # a running server refuses it within one reload
memvit keys set acme --weight 2 --images-per-second 20 --burst 40   # its share and limits
memvit keys set anonymous --images-per-second 5    # the callers without a key: anonymous, admin

The file is rewritten atomically (owner-only), so a server watching it sees the old or the new keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .common import fail

if TYPE_CHECKING:
    from ..tenancy.policy import Policy

app = typer.Typer(help="Manage tenant API keys (the file MEMVIT_API_KEYS_FILE names).", no_args_is_help=True)

KeysFile = Annotated[
    Path | None,
    typer.Option(
        "--file", envvar="MEMVIT_API_KEYS_FILE", help="the keys file (default: $MEMVIT_API_KEYS_FILE)"
    ),
]


def _file(path: Path | None) -> Path:
    if path is None:
        raise fail(ValueError("no keys file: pass --file PATH or set MEMVIT_API_KEYS_FILE"))
    return path


# Each key's share of the passes and its limits (server/tenancy/policy.py), as options of `add` and `set`.
Weight = Annotated[float | None, typer.Option(help="its share of the passes while others wait (default 1)")]
Rate = Annotated[float | None, typer.Option(help="images per second (a token bucket)")]
Burst = Annotated[int | None, typer.Option(help="images at once above the rate (default: one second's)")]
InFlight = Annotated[int | None, typer.Option(help="requests being served at once")]
PerRequest = Annotated[int | None, typer.Option(help="images in one request")]


def _policy(base: Policy, weight: float | None, *limit_options: float | None) -> Policy:
    """``base`` with the options given replaced (``limit_options`` in ``LIMIT_FIELDS``' order)."""
    from ..tenancy.policy import LIMIT_FIELDS, PolicyError, parse_policy

    given = {k: v for k, v in zip(LIMIT_FIELDS, limit_options, strict=True) if v is not None}
    limits = {**base.limits.to_json(), **given}
    entry = {"weight": base.weight if weight is None else weight, "limits": limits}
    try:
        return parse_policy(entry, "options")
    except PolicyError as exc:  # named as the options are: --images-per-second, not limits.images_per_second
        message = str(exc).replace("options.limits.", "options.")
        message = re.sub(r"options\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), message)
        raise fail(ValueError(message)) from None


def _describe(policy: Policy) -> list[str]:
    """A policy as the list's weight and limits columns."""
    limits = ",".join(f"{k}={v:g}" for k, v in policy.limits.to_json().items()) or "-"
    return [f"{policy.weight:g}", limits]


@app.command()
def add(
    key_id: Annotated[str, typer.Argument(metavar="ID", help="a label for the key (log and audit trail)")],
    names: Annotated[
        list[str], typer.Option("--names", help="adapter names it covers, a glob (repeat for more)")
    ],
    read: Annotated[bool, typer.Option("--read/--no-read", help="may classify with and list them")] = True,
    write: Annotated[bool, typer.Option("--write/--no-write", help="may register and delete them")] = False,
    weight: Weight = None,
    images_per_second: Rate = None,
    burst: Burst = None,
    requests_in_flight: InFlight = None,
    images_per_request: PerRequest = None,
    file: KeysFile = None,
) -> None:
    """Add a key and print it once (stdout); only its sha256 is stored."""
    from ..tenancy.key_file import add_key
    from ..tenancy.keys import KeysFileError
    from ..tenancy.policy import DEFAULT

    path = _file(file)
    policy = _policy(DEFAULT, weight, images_per_second, burst, requests_in_flight, images_per_request)
    try:
        key = add_key(path, key_id, names, read=read, write=write, policy=policy)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo(key)
    typer.echo(f"key {key_id!r} added to {path}; it is shown only now and not stored anywhere", err=True)


@app.command("list")
def list_keys(file: KeysFile = None) -> None:
    """The keys in the file: id, names, read, write, created, weight, limits (never a key or its hash);
    then the anonymous and admin callers, where their weight or limits are set."""
    from ..tenancy.key_file import load_or_empty
    from ..tenancy.keys import RESERVED_IDS, KeysFileError
    from ..tenancy.policy import DEFAULT

    path = _file(file)
    try:
        ring = load_or_empty(path)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo("id\tnames\tread\twrite\tcreated\tweight\tlimits")
    for key in ring.keys:
        flags = ["yes" if key.read else "no", "yes" if key.write else "no"]
        row = [key.id, ",".join(key.names), *flags, key.created or "-", *_describe(key.policy)]
        typer.echo("\t".join(row))
    for caller in RESERVED_IDS:
        if (policy := ring.policy_of(caller)) != DEFAULT:
            typer.echo("\t".join([caller, "-", "-", "-", "-", *_describe(policy)]))


@app.command()
def revoke(
    key_id: Annotated[str, typer.Argument(metavar="ID", help="the id of the key to remove")],
    file: KeysFile = None,
) -> None:
    """Remove a key; a server watching the file refuses it within MEMVIT_API_KEYS_RELOAD_SECONDS."""
    from ..tenancy.key_file import revoke_key
    from ..tenancy.keys import KeysFileError

    path = _file(file)
    try:
        revoke_key(path, key_id)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo(f"key {key_id!r} revoked in {path}", err=True)


@app.command("set")
def set_policy(
    key_id: Annotated[
        str, typer.Argument(metavar="ID", help="a key's id, or anonymous or admin (the callers without one)")
    ],
    weight: Weight = None,
    images_per_second: Rate = None,
    burst: Burst = None,
    requests_in_flight: InFlight = None,
    images_per_request: PerRequest = None,
    no_limits: Annotated[bool, typer.Option("--no-limits", help="remove every limit first")] = False,
    file: KeysFile = None,
) -> None:
    """Set a key's weight and limits (the options given; the others stay); a running server applies
    them within MEMVIT_API_KEYS_RELOAD_SECONDS."""
    from ..tenancy.key_file import load_or_empty
    from ..tenancy.key_file import set_policy as write_policy
    from ..tenancy.keys import RESERVED_IDS, KeysFileError
    from ..tenancy.policy import Policy

    path = _file(file)
    try:
        ring = load_or_empty(path)
        key = ring.by_id(key_id)
        if key is None and key_id not in RESERVED_IDS:
            raise KeysFileError(f"no key with id {key_id!r} in {path}")
        current = key.policy if key is not None else ring.policy_of(key_id)
        if no_limits:
            current = Policy(current.weight)
        policy = _policy(current, weight, images_per_second, burst, requests_in_flight, images_per_request)
        write_policy(path, key_id, policy)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo(f"{key_id}: weight {_describe(policy)[0]}, limits {_describe(policy)[1]} ({path})", err=True)
