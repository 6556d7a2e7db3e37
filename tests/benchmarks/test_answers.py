"""The check of every answer under load (benchmarks/answers.py): against the image's answer alone,
logits within the tolerance, the top-1 where the reference's margin allows; refusals by reason."""

from __future__ import annotations

import json
import math

from benchmarks.answers import check, reason_of

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
