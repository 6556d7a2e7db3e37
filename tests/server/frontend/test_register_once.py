"""POST /adapters through an API process parses its bundle once: the API process reads it (to check
it against the caller's key) and hands the parsed bundle to the model process with the bytes; a
broken bundle is refused there with its 422 before anything crosses the link."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memvit.adapters import AdapterBundle, BundleError
from memvit.memory_core import LiveAdapters
from memvit.server.frontend.remote import RemoteRegistry
from memvit.server.registry import AdapterRegistry
from memvit.server.registry import registry as registry_module
from memvit.server.store import open_store


class FakeLink:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def call_sync(self, method: str, *args):
        self.calls.append((method, *args))
        return "answer"


def remote(link: FakeLink) -> RemoteRegistry:
    """A RemoteRegistry's registering side alone (its catalog only refreshed after a change)."""
    replica = RemoteRegistry.__new__(RemoteRegistry)
    replica.link, replica.max_bundle_bytes = link, 1 << 22
    replica.catalog = SimpleNamespace(refresh=lambda: None)
    return replica


def test_the_model_process_registers_the_bundle_the_api_process_parsed(
    make_bundle, tiny_engine_for_bundles, tmp_path, monkeypatch
) -> None:
    data = make_bundle("once").to_bytes()
    link, seen = FakeLink(), []
    assert remote(link).register(data, replace=True, authorize=seen.append) == "answer"
    ((method, sent, replace, parsed),) = link.calls
    assert (method, sent, replace) == ("register", data, True)
    assert isinstance(parsed, AdapterBundle) and seen == [parsed] and parsed.name == "once"

    # The model process's registry takes it as parsed: reading the bytes again would fail here.
    def no_second_parse(*args, **kwargs):
        raise AssertionError("the bundle was parsed a second time")

    monkeypatch.setattr(registry_module, "read_bundle", no_second_parse)
    engine = LiveAdapters(tiny_engine_for_bundles)
    model = AdapterRegistry(engine, open_store(str(tmp_path)), max_bundle_bytes=1 << 22)
    model.open()
    try:
        entry, _, replaced = model.register(sent, replace=replace, parsed=parsed)
        assert entry.name == "once" and not replaced and model.all_names() == ["once"]
    finally:
        model.close()


def test_a_broken_bundle_is_refused_before_the_link(make_bundle) -> None:
    data = bytearray(make_bundle("broken").to_bytes())
    data[20:40] = b"\xff" * 20  # the safetensors header, damaged
    link = FakeLink()
    with pytest.raises(BundleError):
        remote(link).register(bytes(data))
    assert link.calls == []
