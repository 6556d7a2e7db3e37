"""``memvit keys``: the tenant keys file (server/keys.py) that ``MEMVIT_API_KEYS_FILE`` names.

memvit keys add acme --names 'acme-*' --write     # prints the new key once; only its sha256 is kept
memvit keys list                                   # id, names, read, write, created (never a hash)
memvit keys revoke acme                            # a running server refuses it within one reload

The file is rewritten atomically (owner-only), so a server watching it sees the old or the new keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import fail

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


@app.command()
def add(
    key_id: Annotated[str, typer.Argument(metavar="ID", help="a label for the key (log and audit trail)")],
    names: Annotated[
        list[str], typer.Option("--names", help="adapter names it covers, a glob (repeat for more)")
    ],
    read: Annotated[bool, typer.Option("--read/--no-read", help="may classify with and list them")] = True,
    write: Annotated[bool, typer.Option("--write/--no-write", help="may register and delete them")] = False,
    file: KeysFile = None,
) -> None:
    """Add a key and print it once (stdout); only its sha256 is stored."""
    from ..keys import KeysFileError, add_key

    path = _file(file)
    try:
        key = add_key(path, key_id, names, read=read, write=write)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo(key)
    typer.echo(f"key {key_id!r} added to {path}; it is shown only now and not stored anywhere", err=True)


@app.command("list")
def list_keys(file: KeysFile = None) -> None:
    """The keys in the file: id, names, read, write, created (never a key or its hash)."""
    from ..keys import KeysFileError, load_or_empty

    path = _file(file)
    try:
        ring = load_or_empty(path)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo("id\tnames\tread\twrite\tcreated")
    for key in ring.keys:
        flags = ["yes" if key.read else "no", "yes" if key.write else "no"]
        typer.echo("\t".join([key.id, ",".join(key.names), *flags, key.created or "-"]))


@app.command()
def revoke(
    key_id: Annotated[str, typer.Argument(metavar="ID", help="the id of the key to remove")],
    file: KeysFile = None,
) -> None:
    """Remove a key; a server watching the file refuses it within MEMVIT_API_KEYS_RELOAD_SECONDS."""
    from ..keys import KeysFileError, revoke_key

    path = _file(file)
    try:
        revoke_key(path, key_id)
    except (KeysFileError, OSError) as exc:
        raise fail(exc) from None
    typer.echo(f"key {key_id!r} revoked in {path}", err=True)
