"""benchmarks/logits_cost.py: the GPU suite's answer shape, every logits answer checked, and its smoke
prints both rows."""

from __future__ import annotations

from benchmarks.logits_cost import check_cost, main


def test_the_check_is_timed_on_an_answer_of_the_gpu_suites_shape() -> None:
    fast, slow, size = check_cost(number=20)  # raises if either check finds the answer wrong
    assert size > 30_000 and fast > 0 and slow > 0  # a 1,000-class base and 8 x 100: ~1,800 numbers


def test_smoke(capsys) -> None:
    main(["--smoke", "--config", "1 device"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| now |")]
    (plain, logits) = (row.split("|")[3:7] for row in rows)
    assert float(plain[0]) > 0 and float(logits[0]) > 0  # the server's CPU per request
    assert float(logits[2]) > float(plain[2])  # the load generator checks every logits answer
