"""Tenant keys: the file's format, matching, hashing at rest, reloads and revocation."""

from __future__ import annotations

import json
import os
import stat

import pytest

from memvit.server.tenancy.key_file import KeyFile, add_key, load_or_empty, revoke_key
from memvit.server.tenancy.keys import FORMAT, KeyRing, KeysFileError, hash_key


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_add_stores_only_the_hash_and_matches_by_glob(tmp_path):
    path = tmp_path / "keys.json"
    key = add_key(path, "acme", ["acme-*"], read=True, write=True)
    text = path.read_text()
    assert key not in text and hash_key(key) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    found = load_or_empty(path).lookup(key)
    assert found is not None and found.id == "acme"
    assert found.may_write("acme-cats") and found.may_read("acme-cats")
    assert not found.may_write("globex-dogs") and not found.may_read("globex-dogs")
    assert load_or_empty(path).lookup(key + "x") is None


def test_read_only_key_cannot_write(tmp_path):
    path = tmp_path / "keys.json"
    key = add_key(path, "viewer", ["acme-*", "shared"], read=True, write=False)
    found = load_or_empty(path).lookup(key)
    assert found.may_read("shared") and found.may_read("acme-x")
    assert not found.may_write("acme-x")


def test_duplicate_id_is_refused_and_revoke_removes(tmp_path):
    path = tmp_path / "keys.json"
    key = add_key(path, "acme", ["acme-*"], read=True, write=True)
    with pytest.raises(KeysFileError, match="exists already"):
        add_key(path, "acme", ["x"], read=True, write=False)
    assert revoke_key(path, "acme").id == "acme"
    assert load_or_empty(path).lookup(key) is None
    with pytest.raises(KeysFileError, match="no key with id"):
        revoke_key(path, "acme")


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"id": "a", "sha256": "00", "names": "*"}, "sha256"),
        ({"id": "", "sha256": "0" * 64, "names": "*"}, "id"),
        ({"id": "a", "sha256": "0" * 64, "names": ""}, "names"),
        ({"id": "a", "sha256": "0" * 64, "names": "*", "write": "yes"}, "write"),
        ({"id": "a", "sha256": "0" * 64, "names": "*", "admin": True}, "unknown"),
    ],
)
def test_malformed_entries_name_the_field(entry, problem):
    with pytest.raises(KeysFileError, match=problem):
        KeyRing.parse(json.dumps({"format": FORMAT, "keys": [entry]}))


def test_malformed_documents_are_refused():
    for text in (
        "not json",
        "[]",
        json.dumps({"format": "other", "keys": []}),
        json.dumps({"format": FORMAT}),
    ):
        with pytest.raises(KeysFileError):
            KeyRing.parse(text)
    twice = {"id": "a", "sha256": "0" * 64, "names": "*"}
    with pytest.raises(KeysFileError, match="share"):
        KeyRing.parse(json.dumps({"format": FORMAT, "keys": [twice, {**twice, "id": "b"}]}))


def test_key_file_reloads_within_one_interval_and_survives_a_bad_edit(tmp_path):
    path = tmp_path / "keys.json"
    acme = add_key(path, "acme", ["acme-*"], read=True, write=True)
    clock = FakeClock()
    keys = KeyFile(path, reload_seconds=2.0, clock=clock)
    assert keys.ring().lookup(acme) is not None

    revoke_key(path, "acme")
    clock.now = 1.0  # inside the interval: not looked at yet
    assert keys.ring().lookup(acme) is not None
    clock.now = 2.5  # one interval later: the revocation is seen
    assert keys.ring().lookup(acme) is None

    globex = add_key(path, "globex", ["globex-*"], read=True, write=False)
    path.write_text("{broken")  # a bad edit keeps the last good keys (never opens the door)
    clock.now = 5.0
    assert keys.ring().lookup(globex) is None  # the broken file was not loaded...
    assert len(keys.ring()) == 0  # ...and the last good version (no keys after the revoke) stays


def test_missing_or_bad_file_is_fatal_at_start(tmp_path):
    with pytest.raises(OSError):
        KeyFile(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(KeysFileError):
        KeyFile(tmp_path / "bad.json")
