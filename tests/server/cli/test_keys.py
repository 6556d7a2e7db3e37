"""``memvit keys add/list/revoke``: the key is printed once and never stored, the file holds only its
hash, and the file comes from --file or MEMVIT_API_KEYS_FILE."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memvit.server.cli import app
from memvit.server.tenancy.key_file import load_or_empty
from memvit.server.tenancy.keys import KEY_PREFIX, hash_key
from memvit.server.tenancy.policy import Limits, Policy

runner = CliRunner()


def test_add_list_revoke_round_trip(tmp_path) -> None:
    path = tmp_path / "keys.json"
    added = runner.invoke(
        app,
        ["keys", "add", "acme", "--names", "acme-*", "--names", "shared-*", "--write", "--file", str(path)],
    )
    assert added.exit_code == 0, added.output
    key = added.stdout.strip()
    assert key.startswith(KEY_PREFIX) and "\n" not in key
    assert "shown only now" in added.stderr and key not in added.stderr
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    stored = load_or_empty(path).lookup(key)
    assert stored is not None and stored.names == ("acme-*", "shared-*") and stored.read and stored.write

    reader = runner.invoke(app, ["keys", "add", "audit", "--names", "*", "--no-read", "--file", str(path)])
    assert reader.exit_code == 0, reader.output
    audit = load_or_empty(path).by_id("audit")
    assert audit is not None and (audit.read, audit.write) == (False, False)

    listed = runner.invoke(app, ["keys", "list", "--file", str(path)])
    assert listed.exit_code == 0, listed.output
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert rows[0] == ["id", "names", "read", "write", "created", "weight", "limits"]
    assert [row[:4] + row[5:] for row in rows[1:]] == [
        ["acme", "acme-*,shared-*", "yes", "yes", "1", "-"],
        ["audit", "*", "no", "no", "1", "-"],
    ]
    assert hash_key(key) not in listed.output and key not in listed.output

    revoked = runner.invoke(app, ["keys", "revoke", "acme", "--file", str(path)])
    assert revoked.exit_code == 0, revoked.output
    assert load_or_empty(path).lookup(key) is None
    assert [k["id"] for k in json.loads(path.read_text())["keys"]] == ["audit"]


def test_the_file_comes_from_the_environment_or_is_asked_for(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MEMVIT_API_KEYS_FILE", raising=False)
    missing = runner.invoke(app, ["keys", "list"])
    assert missing.exit_code == 2 and "pass --file PATH or set MEMVIT_API_KEYS_FILE" in missing.output
    path = tmp_path / "keys.json"
    monkeypatch.setenv("MEMVIT_API_KEYS_FILE", str(path))
    assert runner.invoke(app, ["keys", "add", "acme", "--names", "acme-*"]).exit_code == 0
    assert "acme" in runner.invoke(app, ["keys", "list"]).stdout


def test_mistakes_are_one_line_and_change_nothing(tmp_path) -> None:
    path = tmp_path / "keys.json"
    assert (
        runner.invoke(app, ["keys", "add", "acme", "--names", "acme-*", "--file", str(path)]).exit_code == 0
    )
    before = path.read_text()
    again = runner.invoke(app, ["keys", "add", "acme", "--names", "acme-*", "--file", str(path)])
    assert again.exit_code == 2 and "exists already" in again.output
    unknown = runner.invoke(app, ["keys", "revoke", "nobody", "--file", str(path)])
    assert unknown.exit_code == 2 and "no key with id 'nobody'" in unknown.output
    bad_id = runner.invoke(app, ["keys", "add", "no spaces", "--names", "x", "--file", str(path)])
    assert bad_id.exit_code == 2 and ".id:" in bad_id.output
    assert path.read_text() == before


def test_weights_and_limits_are_set_and_listed(tmp_path) -> None:
    path = tmp_path / "keys.json"
    add = [
        "keys",
        "add",
        "acme",
        "--names",
        "acme-*",
        "--weight",
        "2",
        "--images-per-second",
        "20",
        "--file",
        str(path),
    ]
    assert runner.invoke(app, add).exit_code == 0
    ring = load_or_empty(path)
    assert ring.by_id("acme").policy == Policy(2.0, Limits(images_per_second=20.0))
    # `set` changes the options given and keeps the rest; anonymous and admin are set the same way.
    r = runner.invoke(
        app, ["keys", "set", "acme", "--burst", "40", "--requests-in-flight", "8", "--file", str(path)]
    )
    assert r.exit_code == 0, r.output
    assert load_or_empty(path).by_id("acme").policy == Policy(
        2.0, Limits(images_per_second=20.0, burst=40, requests_in_flight=8)
    )
    assert (
        runner.invoke(
            app, ["keys", "set", "anonymous", "--images-per-second", "5", "--file", str(path)]
        ).exit_code
        == 0
    )
    listed = [
        line.split("\t")
        for line in runner.invoke(app, ["keys", "list", "--file", str(path)]).stdout.splitlines()
    ]
    assert listed[1][0] == "acme" and listed[1][5:] == [
        "2",
        "images_per_second=20,burst=40,requests_in_flight=8",
    ]
    assert listed[2] == ["anonymous", "-", "-", "-", "-", "1", "images_per_second=5"]
    r = runner.invoke(app, ["keys", "set", "acme", "--no-limits", "--file", str(path)])
    assert r.exit_code == 0 and load_or_empty(path).by_id("acme").policy == Policy(2.0)
    # Bad values are named as the options are, and change nothing.
    before = path.read_text()
    r = runner.invoke(app, ["keys", "set", "acme", "--weight", "0", "--file", str(path)])
    assert r.exit_code == 2 and "--weight: a number above 0" in r.output
    r = runner.invoke(app, ["keys", "set", "acme", "--burst", "3", "--file", str(path)])
    assert r.exit_code == 2 and "--burst: needs images_per_second" in r.output
    r = runner.invoke(app, ["keys", "set", "nobody", "--weight", "2", "--file", str(path)])
    assert r.exit_code == 2 and "no key with id 'nobody'" in r.output
    assert path.read_text() == before
