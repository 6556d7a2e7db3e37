"""Many tenants on one server: fair shares, per-key limits, their cost, and usage across replicas.

    python -m benchmarks.tenants                       # ~15 minutes on 2 cores
    python -m benchmarks.tenants --seconds 10 --share-seconds 30 --usage-requests 3000   # a quick look

The embedded demo model serves (``memvit serve`` as a child process, its small samples as uploads),
so that the model is fast and what is measured is the scheduling; every phase's load comes from
closed-loop clients with prepared requests (benchmarks/loadgen.py's client). This machine's speed
drifts with the other work on it, so each comparison alternates its two servers, phase by phase,
over ``--rounds`` rounds, and reports medians.

1. Latency: key B keeps 1 request (1 image) in flight, alone, then while key A keeps 32 in flight
   (1 image each, and 8 images each: a backlog many passes deep); fair batching on, and off (by
   arrival, as before keys had shares). B's p50 against its p50 alone.
2. Shares: A (weight 1) and B (weight 2) both backlogged (64 requests in flight each) for
   ``--share-seconds``: each key's share of the images answered against its weight's share.
3. Limits: key L (20 images/s, burst 10) sends as fast as 4 clients can while key F (no limit)
   does too: L's 429s, its images admitted over every window against 20 x T + 10, F's errors.
4. Cost: throughput of 32 clients (two keys, 16 each) with fairness, weights, limits (set, never
   reached) and usage on, against the server as it was before them, with the same keys
   (``--baseline``: a git revision of this repository, run from its own files; or the same code
   with all three off), in ``--cost-rounds`` back-to-back pairs: the median of the pairs' ratios,
   and the servers' CPU per image (which the machine's other load moves much less).
5. Usage: ``--usage-requests`` requests from 3 keys over 2 replicas sharing one store, one replica
   SIGKILLed and restarted part-way: the usage written against the requests answered; what is
   missing must be no more than what the killed replica answered in its last interval.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import argument_parser, environment
from benchmarks.tenant_costs import cost, usage
from benchmarks.tenant_load import (
    SAMPLES,
    Group,
    Servers,
    classify_request,
    drive,
    p50_ms,
    passes,
)
from memvit.server.tenancy.key_file import add_key
from memvit.server.tenancy.policy import Limits, Policy
from tests.server.launcher import ServerProcess


def latency(servers: Servers, fair: ServerProcess, fifo: ServerProcess, args) -> dict:
    print("\n## 1. B's latency, alone and beside A's backlog (p50 ms; medians of the rounds)\n")
    cases = {"alone": None, "A 32 x 1 image": 1, "A 32 x 8 images": 8}
    found: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for case, a_images in cases.items():
            for label, server in (("on", fair), ("off", fifo)):
                groups = {"B": Group(classify_request(server.port, servers.keys["b"]), 1)}
                if a_images:
                    a = classify_request(server.port, servers.keys["a"], a_images)
                    groups["A"] = Group(a, 32, a_images)
                before = passes(server.port)
                since = drive(server.port, groups, args.seconds)
                after = passes(server.port)
                found.setdefault((case, label), []).append(p50_ms(groups["B"].done, since))
                count = max(after[0] - before[0], 1)
                found.setdefault((case, label + " pass"), []).append(1e3 * (after[2] - before[2]) / count)
                found.setdefault((case, label + " batch"), []).append((after[1] - before[1]) / count)
                errors = sum(d.status != 200 for g in groups.values() for d in g.done)
                if errors:
                    found.setdefault((case, label + " errors"), []).append(errors)
    print("| A's load | fairness | B p50 ms | / B alone | mean pass ms (images) | B p50 in passes |")
    print("|---|---|--:|--:|--:|--:|")
    med = {k: statistics.median(v) for k, v in found.items()}
    for case in cases:
        for label in ("on", "off"):
            b, pass_ms = med[(case, label)], med[(case, label + " pass")]
            print(f"| {case} | {label} | {b:.1f} | {b / med[('alone', label)]:.2f} | {pass_ms:.1f} "
                  f"({med[(case, label + ' batch')]:.1f}) | {b / pass_ms:.1f} |")  # fmt: skip
    for (case, label), values in found.items():
        if label.endswith("errors"):
            print(
                f"non-200 answers, {case}, fairness {label.split()[0]}: {sum(values)} (503: A's queue full)"
            )
    return med


def shares(servers: Servers, fair: ServerProcess, fifo: ServerProcess, args) -> dict:
    seconds = args.share_seconds
    print(f"\n## 2. Shares of images, A (weight 1) and B (weight 2) both backlogged, {seconds:.0f} s\n")
    print("| fairness | A's images | B's images | B's share | B's share / its weight's (2/3) |")
    print("|---|--:|--:|--:|--:|")
    out = {}
    for label, server in (("on", fair), ("off", fifo)):
        groups = {who: Group(classify_request(server.port, servers.keys[who]), 64) for who in ("a", "b")}
        since = drive(server.port, groups, args.share_seconds)
        end = min(max(d.ended for d in g.done) for g in groups.values())
        counted = {w: sum(d.images for d in g.done if since <= d.ended <= end and d.status == 200)
                   for w, g in groups.items()}  # fmt: skip
        share = counted["b"] / (counted["a"] + counted["b"])
        out[label] = share / (2 / 3)
        print(f"| {label} | {counted['a']} | {counted['b']} | {share:.3f} | {out[label]:.3f} |")
    return out


def limits(servers: Servers, fair: ServerProcess, args) -> dict:
    rate, burst = 20.0, 10
    print(f"\n## 3. Limits: key L at {rate:g} images/s, burst {burst}, against a key without limits\n")
    groups = {"L": Group(classify_request(fair.port, servers.keys["l"]), 4),
              "F": Group(classify_request(fair.port, servers.keys["f"]), 4)}  # fmt: skip
    drive(fair.port, groups, args.seconds)
    ok = sorted((d for d in groups["L"].done if d.status == 200), key=lambda d: d.began)
    refused = sum(d.status == 429 for d in groups["L"].done)
    worst = 0.0
    # A request answered 200 was admitted between its send and its answer: those wholly inside a
    # window were admitted in it. Every window that starts at a send and ends at an answer.
    for i, first in enumerate(ok):
        for last in ok[i:]:
            if last.ended <= first.began:
                continue
            inside = sum(d.images for d in ok[i:] if d.ended <= last.ended)
            worst = max(worst, inside / (burst + rate * (last.ended - first.began)))
    span = ok[-1].ended - ok[0].began
    total = sum(d.images for d in ok) / (burst + rate * span)
    f_errors = sum(d.status != 200 for d in groups["F"].done)
    print(f"L: {len(ok)} answered, {refused} refused with 429; F: {len(groups['F'].done)} answered, "
          f"{f_errors} not 200")  # fmt: skip
    print(f"L's images in the worst window / (burst + rate x window): {worst:.3f}; over the whole "
          f"run ({span:.1f} s): {total:.3f}")  # fmt: skip
    return {"worst": worst, "refused": refused, "other_errors": f_errors}


def main(argv: list[str] | None = None) -> None:
    parser = argument_parser(__file__, __doc__)
    parser.add_argument("--seconds", type=float, default=15.0, help="per latency, limit and cost phase")
    parser.add_argument("--share-seconds", type=float, default=60.0, help="the shares' phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cost-rounds", type=int, default=10, help="paired rounds of the cost phase")
    parser.add_argument("--cost-seconds", type=float, default=8.0, help="per server per cost round")
    parser.add_argument("--usage-requests", type=int, default=10_000)
    parser.add_argument("--baseline", default="main", help="git revision for 'today' ('' : features off)")
    parser.add_argument("--only", default="latency,shares,limits,cost,usage", help="the phases to run")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    print(environment("the embedded demo model", f"{len(SAMPLES)} demo samples (PNG)"))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        keys_file = tmp / "keys.json"
        ids = {"a": "A", "b": "B", "c": "C", "l": "L", "f": "F"}
        policies = {"b": Policy(weight=2.0), "l": Policy(limits=Limits(images_per_second=20, burst=10)),
                    "a": Policy(limits=Limits(images_per_second=1e6, requests_in_flight=1000))}  # fmt: skip
        keys = {w: add_key(keys_file, ids[w], ["*"], read=True, write=False, policy=policies.get(w, Policy()))
                for w in ids}  # fmt: skip
        servers = Servers(tmp, keys_file, keys, ids)
        results: dict = {}
        try:
            if only & {"latency", "shares", "limits"}:
                # Room for A's 32 x 8 images in the queue: what is measured is the order, not refusals.
                fair = servers.start("fair", MEMVIT_MAX_QUEUE="1024")
                fifo = servers.start("fifo", MEMVIT_MAX_QUEUE="1024", MEMVIT_FAIR_BATCHING="false")
                if "latency" in only:
                    results["latency"] = latency(servers, fair, fifo, args)
                if "shares" in only:
                    results["shares"] = shares(servers, fair, fifo, args)
                if "limits" in only:
                    results["limits"] = limits(servers, fair, args)
                for server in (fair, fifo):
                    server.stop()
            if "cost" in only:
                results["cost"] = cost(servers, args)
            if "usage" in only:
                results["usage"] = usage(servers, args)
        finally:
            servers.stop()
    goals(results)


def goals(results: dict) -> None:
    print("\n## Goals\n")
    if med := results.get("latency"):
        cases = ("A 32 x 1 image", "A 32 x 8 images")
        on = {k: med[(k, "on")] / med[("alone", "on")] for k in cases}
        off = {k: med[(k, "off")] / med[("alone", "off")] for k in cases}
        print(f"- B's p50 beside A (32 x 1 image) / alone: {on[cases[0]]:.2f} (goal <= 1.5; by arrival: "
              f"{off[cases[0]]:.2f}); beside a backlog of 32 x 8 images: {on[cases[1]]:.2f} (by arrival: "
              f"{off[cases[1]]:.2f})")  # fmt: skip
    if share := results.get("shares"):
        print(f"- B's share / its weight's share, both backlogged: {share['on']:.3f} (goal 0.90-1.10; "
              f"by arrival: {share['off']:.3f})")  # fmt: skip
    if limited := results.get("limits"):
        print(
            f"- L's worst window / (limit x window + burst): {limited['worst']:.3f} (goal <= 1), "
            f"{limited['refused']} 429s; the other key's errors: {limited['other_errors']} (goal 0)"
        )
    if "cost" in results:
        print(f"- throughput with fairness, limits and usage / today's: {results['cost']:.3f} (goal >= 0.97)")
    if used := results.get("usage"):
        print(
            f"- usage missing after a SIGKILL: {used['lost']} (goal: 0 <= missing <= {used['bound']}, "
            "what the killed replica answered in its last interval)"
        )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
