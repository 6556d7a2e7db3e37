"""The check of every answer under load (benchmarks/answers.py): against the image's answer alone,
logits within the tolerance, the top-1 where the reference's margin allows; refusals by reason."""

from __future__ import annotations

import json
import math

import numpy as np

from benchmarks.answers import Expected, check, prepared, reason_of

REF = {"base": [2.0, 1.0, -1.0], "a": [0.5, 0.4996, 0.0]}  # a: top-2 margin 4e-4, under 1e-3


def test_an_answer_within_the_tolerance_is_right() -> None:
    assert check({"base": [2.0005, 1.0, -1.0], "a": [0.4996, 0.5, 0.0]}, REF, 1e-3) is None  # a tie may flip


def test_wrong_answers_say_why() -> None:
    assert check({"base": [2.01, 1.0, -1.0], "a": REF["a"]}, REF, 1e-3) == "base: logits off"
    assert check({"base": [1.5, 1.55, -1.0], "a": REF["a"]}, REF, 0.6) == "base: top-1 differs"
    assert check({"base": [math.nan, 1.0, -1.0], "a": REF["a"]}, REF, 1e-3) == "base: non-finite logits"
    assert check({"base": REF["base"]}, REF, 1e-3) == "other tasks"
    assert check({"base": [2.0, 1.0], "a": REF["a"]}, REF, 1e-3) == "base: other classes"


def answer(tasks: dict) -> bytes:
    result = {"image": "photo-0", "tasks": {t: {"logits": v} for t, v in tasks.items()}}
    return json.dumps({"results": [result]}).encode()


def test_reasons_to_count_answers_by() -> None:
    refs = {"photo-0": REF}
    assert reason_of(200, answer(REF), "photo-0", refs, 1e-3) == "200"
    off = answer({**REF, "base": [9, 1, 1]})
    assert reason_of(200, off, "photo-0", refs, 1e-3) == "200 wrong: base: logits off"
    body = json.dumps({"error": {"type": "NonFiniteOutputError", "message": "internal error"}}).encode()
    assert reason_of(500, body, "photo-0", refs, 1e-3) == "500 NonFiniteOutputError: internal error"
    assert reason_of(503, b"<html>", "photo-0", refs, 1e-3) == "503 unparsed: <html>"
    assert reason_of(200, b"{}", "photo-0", refs, 1e-3) == "200 wrong: unreadable answer (KeyError)"


def test_prepared_references_say_the_same() -> None:
    """A load prepares each reference once (``prepared``); every reason is the raw reference's."""
    refs = {"photo-0": REF}
    ready = prepared(refs)
    flipped = answer({**REF, "base": [1.5, 1.55, -1.0]})  # within 0.6, but not the top-1 (margin 1)
    bodies = [answer(REF), answer({**REF, "base": [9, 1, 1]}), flipped, answer({"base": REF["base"]})]
    bodies += [answer({**REF, "base": [math.inf, 1.0, -1.0]}), answer({**REF, "a": [0.0, 0.6]})]
    for body in bodies:
        assert reason_of(200, body, "photo-0", ready, 0.6) == reason_of(200, body, "photo-0", refs, 0.6)
    assert reason_of(200, flipped, "photo-0", ready, 0.6) == "200 wrong: base: top-1 differs"


def test_the_margin_is_the_top_two_logits_apart() -> None:
    assert Expected.of([1.0, 3.0, 2.0]).top1 == 1 and Expected.of([1.0, 3.0, 2.0]).margin == 1.0
    tied = Expected.of([3.0, 1.0, 3.0])  # a tie at the top: no margin, either may win
    assert tied.top1 == 0 and tied.margin == 0.0
    assert check({"t": [2.0, 1.0, 3.0]}, {"t": [3.0, 1.0, 3.0]}, 1.5) is None
    assert Expected.of([5.0]).margin == math.inf


def test_the_prepared_fast_check_passes_exactly_what_the_task_by_task_check_passes() -> None:
    """``Prepared.holds`` (every task's logits as one array, the top-1 compared only where a margin
    within 4x the tolerance could flip it) against ``check`` on the raw reference, over answers
    nudged at random, close margins, nulls and other class counts included (every reason occurs)."""
    rng = np.random.default_rng(0)
    tolerance, seen = 1e-3, set()
    for trial in range(300):
        ref = {t: rng.standard_normal(int(rng.integers(1, 6))).tolist() for t in ("base", "a", "b")}
        if trial % 3 == 0:  # the base's top two close: 1-5x the tolerance apart
            top = int(np.argmax(ref["base"]))
            ref["base"] = [*ref["base"], ref["base"][top] - tolerance * float(rng.uniform(1, 5))]
        got = {t: (np.array(v) + rng.normal(0, tolerance / 2, len(v))).tolist() for t, v in ref.items()}
        if trial % 6 == 0:  # the close two pushed together by just under the tolerance: some swap
            got["base"][top] = ref["base"][top] - 0.99 * tolerance
            got["base"][-1] = ref["base"][-1] + 0.99 * tolerance
        if trial % 10 == 1:
            got["a"] = [*got["a"], 0.0]
        if trial % 10 == 2:
            got["b"] = [None, *got["b"][1:]]
        if trial % 50 == 3:  # no logits at all (a request that did not ask)
            got["a"] = None
        ready = prepared({"p": ref})["p"]
        expected = reason_of(200, answer(got), "p", {"p": ref}, tolerance)
        assert reason_of(200, answer(got), "p", {"p": ready}, tolerance) == expected
        assert ready.holds(got, tolerance) == (expected == "200")
        seen.add(expected.rsplit(": ", 1)[-1])
    assert seen == {"200", "logits off", "other classes", "non-finite logits", "top-1 differs"}
