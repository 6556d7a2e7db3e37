"""Per-key limits on their own: the token bucket's bound over any window, Retry-After, requests in
flight, the largest request, a policy changed by a reload; and the keys file's weight and limits."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memvit.server.errors import RateLimitedError, TooManyImagesError
from memvit.server.tenancy.key_file import add_key, load_or_empty, set_policy
from memvit.server.tenancy.keys import KeyRing, KeysFileError
from memvit.server.tenancy.limits import Limiter, TokenBucket
from memvit.server.tenancy.policy import Limits, Policy


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.5, 50),
    burst=st.integers(1, 20),
    arrivals=st.lists(st.tuples(st.floats(0, 2), st.integers(1, 5)), min_size=1, max_size=80),
)
def test_a_bucket_admits_at_most_burst_plus_rate_times_any_window(rate, burst, arrivals) -> None:
    bucket = TokenBucket(rate, burst, now=0.0)
    now, admitted = 0.0, []
    for gap, n in arrivals:
        now += gap
        if n <= burst and bucket.take(n, now) == 0:
            admitted.append((now, n))
    for i, (start, _) in enumerate(admitted):
        for end, _ in admitted[i:]:
            images = sum(n for t, n in admitted if start <= t <= end)
            assert images <= burst + rate * (end - start) + 1e-6


def test_a_bucket_says_how_long_until_there_is_room() -> None:
    bucket = TokenBucket(rate=2.0, capacity=4, now=0.0)
    assert bucket.take(4, 0.0) == 0 and bucket.tokens == 0
    assert bucket.take(3, 0.5) == pytest.approx(1.0)  # 1 token there, 2 more at 2/s: 1 s
    assert bucket.tokens == pytest.approx(1.0)  # nothing taken by a refusal
    assert bucket.take(3, 1.5) == 0
    bucket.configure(rate=1.0, capacity=2)  # a reload: at most the new capacity is kept
    assert bucket.wait(2, 100.0) == 0 and bucket.tokens == 2


def test_limiter_refuses_past_each_limit_and_names_it() -> None:
    clock = Clock()
    limiter = Limiter(clock=clock)
    policy = Policy(limits=Limits(images_per_second=2, burst=3, requests_in_flight=2, images_per_request=3))
    first = limiter.admit("acme", policy)
    first.charge(3)  # the bucket is empty now
    with pytest.raises(RateLimitedError) as refused:  # from the headers alone: not one token left
        limiter.admit("acme", policy)
    assert refused.value.limit == "images_per_second" and refused.value.headers() == {"Retry-After": "1"}
    assert "2 images per second (burst 3)" in str(refused.value)
    clock.now += 1.0  # 2 tokens
    second = limiter.admit("acme", policy)
    with pytest.raises(RateLimitedError) as refused:
        second.charge(3)
    assert refused.value.retry_after == pytest.approx(0.5)
    assert refused.value.headers() == {"Retry-After": "1"}  # whole seconds, at least 1
    with pytest.raises(RateLimitedError) as refused:  # two in flight: first and second
        limiter.admit("acme", policy)
    assert refused.value.limit == "requests_in_flight"
    assert limiter.admit("globex", policy).tenant == "globex"  # another key has its own state
    first.release()
    first.release()  # once only
    assert limiter.in_flight("acme") == 1
    with pytest.raises(TooManyImagesError) as too_many:  # could never pass: 413, not 429
        limiter.admit("acme", policy).charge(4)
    assert too_many.value.field == "image" and "at most 3 at once (its images_per_request)" in str(
        too_many.value
    )


def test_the_bucket_caps_the_largest_request_and_no_limit_means_none() -> None:
    assert Limits(images_per_second=1.5).bucket == (1.5, 2)  # default burst: a second's worth
    assert Limits(images_per_second=10, burst=4, images_per_request=8).largest_request == 4
    assert Limits().largest_request is None and Limits().bucket is None
    limiter = Limiter()
    for _ in range(100):
        limiter.admit("anyone", Policy()).charge(1000)


def test_a_lifted_limit_drops_the_bucket_and_a_changed_one_keeps_its_tokens() -> None:
    clock = Clock()
    limiter = Limiter(clock=clock)
    tight = Policy(limits=Limits(images_per_second=1, burst=2))
    limiter.admit("a", tight).charge(2)
    with pytest.raises(RateLimitedError):
        limiter.admit("a", tight)
    limiter.admit("a", Policy()).charge(50)  # the keys file lifted it
    limiter.admit("a", tight).charge(2)  # set again: a fresh, full bucket
    wider = Policy(limits=Limits(images_per_second=1, burst=10))
    with pytest.raises(RateLimitedError):  # widened: the tokens it had (none) stay
        limiter.admit("a", wider)


def test_the_keys_file_holds_weights_and_limits(tmp_path) -> None:
    path = tmp_path / "keys.json"
    add_key(path, "acme", ["acme-*"], read=True, write=False, policy=Policy(2.0, Limits(images_per_second=5)))
    add_key(path, "plain", ["*"], read=True, write=False)
    set_policy(path, "anonymous", Policy(limits=Limits(requests_in_flight=4)))
    ring = load_or_empty(path)
    assert ring.by_id("acme").policy == Policy(2.0, Limits(images_per_second=5.0))
    assert ring.anonymous == Policy(limits=Limits(requests_in_flight=4)) and ring.admin == Policy()
    doc = json.loads(path.read_text())
    assert "weight" not in doc["keys"][1] and "limits" not in doc["keys"][1]  # defaults are not written
    assert "admin" not in doc
    set_policy(path, "acme", Policy())
    assert load_or_empty(path).by_id("acme").policy == Policy()
    with pytest.raises(KeysFileError, match="no key with id 'nobody'"):
        set_policy(path, "nobody", Policy())


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"weight": 0}, "weight: a number above 0, got 0"),
        ({"weight": True}, "weight: a number above 0"),
        ({"limits": {"images_per_second": -1}}, "limits.images_per_second: a number above 0"),
        ({"limits": {"requests_in_flight": 1.5}}, "limits.requests_in_flight: a whole number of at least 1"),
        ({"limits": {"burst": 4}}, "limits.burst: needs images_per_second"),
        ({"limits": {"rps": 4}}, "unknown field(s) ['rps']"),
        ({"limits": [1]}, "limits: an object"),
        ({"id": "admin"}, "'admin' names the admin caller"),
    ],
)
def test_a_bad_weight_or_limit_is_named(entry, message) -> None:
    key = {"id": "acme", "sha256": "0" * 64, "names": "*", **entry}
    with pytest.raises(KeysFileError, match=re.escape(message)):
        KeyRing.parse(json.dumps({"format": "memvit.keys/1", "keys": [key]}))


def test_the_callers_without_a_key_take_only_weight_and_limits() -> None:
    doc = {"format": "memvit.keys/1", "keys": [], "anonymous": {"weight": 0.5, "names": "*"}}
    with pytest.raises(KeysFileError, match="anonymous: an object with 'weight' and/or 'limits'"):
        KeyRing.parse(json.dumps(doc))
    with pytest.raises(KeysFileError, match=r"unknown field\(s\) \['guests'\]"):
        KeyRing.parse(json.dumps({"format": "memvit.keys/1", "keys": [], "guests": {}}))
