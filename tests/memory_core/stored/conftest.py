"""Every test here on one intra-op thread (tests/one_thread.py says why)."""

from tests.one_thread import one_torch_thread  # noqa: F401
