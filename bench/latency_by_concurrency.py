"""The service's latency against the requests in flight, from the clients' records of a run.

`bench/overload.py --raw FILE` writes every request record (JSON lines, one line per run). For
each run this takes the requests that got a 200, counts how many of them were in flight at each
moment (from each one's send to its last byte, on the client's clock), and gives each request
the time average of that count over its own life, ``m``: the concurrency it shared the server
with. Requests are then grouped by ``round(m)``; per group: how many, the median, 90th
percentile (the project's one percentile, `deployments.window.percentile`) and largest
end-to-end latency, and the requests late against ``--slo-ms`` (with
the concurrency at their send, their class and when they were sent).

This is how the EPYC's knee was found (bench/RESULTS.md, 12-03): about 0.1 s more per request up to 9 in
flight and 0.3-0.4 s per request past that, which `bench/door_sim.py`'s ``knee`` shape models.
The door's own points (`policies.admission.ServiceModel`) measure the same thing from inside
the ingress; this needs nothing but the benchmark's output.

Usage::

    .venv/bin/python bench/overload.py --only adaptive --seed 7 --c0 1.04 --c3 1.79 --raw raw.jsonl
    .venv/bin/python bench/latency_by_concurrency.py raw.jsonl --run "adaptive @3x"
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deployments.window import percentile  # noqa: E402


def concurrency(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per request that got a 200 (with send and done times): ``m`` (the mean count of such
    requests in flight over its life, itself included), ``at_send`` (the count just after its
    send), ``e2e_s``, ``criticality`` and ``sent_s``; in send order."""
    ok = sorted((r for r in records if r.get("status") == 200 and r.get("sent_s") is not None
                 and r.get("done_s") is not None and r["done_s"] > r["sent_s"]), key=lambda r: r["sent_s"])
    # +1 at each send, -1 at each done; a done sorts before a send at the same instant
    events = sorted([(r["sent_s"], 1) for r in ok] + [(r["done_s"], -1) for r in ok])
    times, counts, n = [], [], 0
    for t, d in events:
        n += d
        times.append(t)
        counts.append(n)

    def count_at(t: float) -> int:
        i = bisect.bisect_right(times, t) - 1
        return counts[i] if i >= 0 else 0

    def mean_count(a: float, b: float) -> float:
        i = bisect.bisect_right(times, a)
        total, t, c = 0.0, a, count_at(a)
        while i < len(times) and times[i] < b:
            total += c * (times[i] - t)
            t, c = times[i], counts[i]
            i += 1
        return (total + c * (b - t)) / (b - a)

    return [{"m": mean_count(r["sent_s"], r["done_s"]), "at_send": count_at(r["sent_s"]),
             "e2e_s": r["done_s"] - r["sent_s"], "criticality": r.get("criticality"), "sent_s": r["sent_s"]}
            for r in ok]


def table(rows: Sequence[dict[str, Any]], slo_s: float) -> dict[str, Any]:
    """Per ``round(m)``: count, median, p90, max latency; and the late requests."""
    groups: dict[int, list[float]] = {}
    for r in rows:
        groups.setdefault(max(1, round(r["m"])), []).append(r["e2e_s"])
    out = {}
    for k in sorted(groups):
        v = sorted(groups[k])
        out[k] = {"n": len(v), "median_s": round(percentile(v, 50), 3), "p90_s": round(percentile(v, 90), 3),
                  "max_s": round(v[-1], 3)}
    late = [{"m": round(r["m"], 1), "e2e_s": round(r["e2e_s"], 3), "at_send": r["at_send"],
             "criticality": r["criticality"], "sent_s": round(r["sent_s"], 1)} for r in rows if r["e2e_s"] > slo_s]
    return {"by_concurrency": out, "late": late}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", type=Path, help="the JSON lines of bench/overload.py --raw")
    ap.add_argument("--run", action="append", default=None, help="only this run (repeat for more; default all)")
    ap.add_argument("--slo-ms", type=float, default=2000.0)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    runs = [json.loads(line) for line in args.raw.read_text().splitlines() if line.strip()]
    names = [r["name"] for r in runs]
    for name in args.run or []:
        if name not in names:
            ap.error(f"--run: no run {name!r} in {args.raw.name}; runs: {', '.join(names)}")
    result = {r["name"]: table(concurrency(r["records"]), args.slo_ms / 1000.0)
              for r in runs if not args.run or r["name"] in args.run}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for name, doc in result.items():
        print(f"== {name}")
        for k, g in doc["by_concurrency"].items():
            print(f"  {k:3d} in flight: {g['n']:4d} requests, median {g['median_s']:.2f} s, p90 {g['p90_s']:.2f} s, "
                  f"max {g['max_s']:.2f} s")
        for r in doc["late"]:
            print(f"  late: {r['e2e_s']:.2f} s at m {r['m']:.1f} ({r['at_send']} in flight at its send), "
                  f"{r['criticality']}, sent at {r['sent_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
