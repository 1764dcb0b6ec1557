"""Chaos under load: the faults Brownout exists for, while requests keep coming.

A steady open-loop load (Poisson arrivals, bounded in count and time, loopback only; streamed and
whole answers mixed, every request with its own ``X-Request-Id``) runs while the policy actor is
killed twice, an enrichment replica (the audit log's host) once and the model replica once.

What must hold (RELIABILITY.md, "Chaos under load"):

- **No request fails except those deliberately refused.** Every answer is a 200 (a whole answer,
  or a stream ending in ``data: [DONE]`` without an error event), or a deliberate refusal: 429/503
  in OpenAI's error JSON with ``Retry-After``. The one exception is named: a stream whose tokens
  were already flowing from the model replica when it was killed cannot be answered again; it
  must end with an OpenAI-shaped ``error`` event (never a cut connection), and there may be at
  most as many of those as requests were in flight when the replica died.
- **Every record kept, once.** Every request that reached the model has exactly one audit record
  (by the client's request id): every 200 is in the audit log, no id is there twice, and nothing
  is there that was not sent.
- **Nothing waits for a replica that is not there.** Every answer, 200 or refusal, ends within
  ``PROMPT_S`` of being sent: a request that no model replica takes before its deadline is
  refused then (503 ``expired``), not answered when Serve has started a new replica (118 s on the
  2-core AVX2 EPYC, past the client's 90 s time-out; about a minute on the AVX-512 Xeon). And
  only the first ones wait that deadline: once one has expired with nothing answering, the
  ingress knows the model is down and refuses the requests after it at once.
- **The service recovers without a manual step**: after the last fault, requests are answered
  200 again.

``BROWNOUT_CHAOS_RUNS=3`` runs the whole scenario three times in a row (the acceptance check);
CI runs it once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Cluster, kill_replica, policy_actor

RUNS = int(os.environ.get("BROWNOUT_CHAOS_RUNS", "1"))
# The longest any answer may take: the test config's SLO is 2 s, and a request with 8 tokens is
# served in well under a second here; a request that waits for a new model replica takes minutes.
PROMPT_S = 30.0


@dataclass
class Outcome:
    rid: str
    stream: bool
    sent_at: float
    status: int | None = None
    kind: str = "pending"  # ok | refused | stream_error | failed
    detail: str = ""
    ended_at: float | None = None
    first_token: bool = False


@dataclass
class Load:
    """Poisson arrivals at ``rate`` per second for ``duration_s`` in a thread of its own."""

    base_url: str
    headers: dict[str, str]
    rate: float
    duration_s: float
    seed: int
    outcomes: list[Outcome] = field(default_factory=list)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True, name="chaos-load")
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        assert self.thread is not None
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the load did not finish in time"

    async def _run(self) -> None:
        rng = random.Random(self.seed)
        t0 = time.monotonic()
        tasks = []
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=90) as client:
            t = rng.expovariate(self.rate)
            while t < self.duration_s:
                await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
                o = Outcome(rid=f"chaos-{uuid.uuid4().hex[:16]}", stream=rng.random() < 0.5, sent_at=time.monotonic())
                self.outcomes.append(o)
                tasks.append(asyncio.create_task(self._one(client, o)))
                t += rng.expovariate(self.rate)
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, o: Outcome) -> None:
        body = {"model": "brownout-tiny", "messages": [{"role": "user", "content": f"chaos {o.rid}"}],
                "max_tokens": 8, "stream": o.stream}
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"X-Request-Id": o.rid}) as r:
                o.status = r.status_code
                if r.status_code == 200 and o.stream:
                    o.kind, o.detail = await _read_stream(r, o)
                else:
                    text = (await r.aread()).decode("utf-8", "replace")
                    o.kind, o.detail = _judge_whole(r, text)
        except Exception as err:  # noqa: BLE001 - a cut connection or a time-out is a failure
            o.kind, o.detail = "failed", f"{type(err).__name__}: {err}"
        o.ended_at = time.monotonic()


async def _read_stream(r: httpx.Response, o: Outcome) -> tuple[str, str]:
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            continue
        doc = json.loads(data)
        if "error" in doc:
            return "stream_error", json.dumps(doc["error"])[:300]
        if any((c.get("delta") or {}).get("content") for c in doc.get("choices", [])):
            o.first_token = True
    return ("ok", "") if done else ("failed", "stream ended without [DONE]")


def _judge_whole(r: httpx.Response, text: str) -> tuple[str, str]:
    try:
        doc = json.loads(text)
    except ValueError:
        return "failed", f"{r.status_code} not JSON: {text[:200]!r}"
    if r.status_code == 200:
        return ("ok", "") if doc.get("choices") else ("failed", f"200 without choices: {text[:200]}")
    message = (doc.get("error") or {}).get("message") if isinstance(doc, dict) else None
    if r.status_code in (429, 503) and r.headers.get("Retry-After", "").isdigit() and message:
        return "refused", f"{r.status_code} {message}"
    return "failed", f"{r.status_code} {text[:200]}"


def _kill_policy_actor() -> None:
    import ray

    ray.kill(policy_actor(), no_restart=False)  # Ray restarts it (max_restarts=-1)


def _wait_serving(http: httpx.Client, timeout_s: float = 300) -> float:
    """Until a chat request is answered 200; the seconds it took."""
    t0 = time.monotonic()
    while True:
        try:
            r = http.post("/v1/chat/completions", json={
                "model": "brownout-tiny", "messages": [{"role": "user", "content": "are you back?"}],
                "max_tokens": 2})
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout_s, "the service did not answer 200 again"
        time.sleep(2.0)


def _audited(deployed: Cluster, http: httpx.Client, ids: set[str], expected: set[str],
             timeout_s: float = 60) -> list[str]:
    """The client ids of every audit record of this run, once the deferred ones have arrived:
    nothing left in the spool and every ``expected`` id on disk, or ``timeout_s`` passed. (An
    empty spool alone is not enough: a record handed to the audit log replica may still be on its
    way to the file; in one CI run none of the answered requests' records were on disk when the
    check returned, and the test passed alone right after.)"""
    from deployments.enrichments.audit_log import read_all

    deadline = time.monotonic() + timeout_s
    while True:
        mine = [r.get("client_request_id") for r in read_all(deployed.data_dir / "audit")
                if r.get("client_request_id") in ids]
        pending = sum((http.get("/admin/brownout").json().get("ingress", {}).get("pipeline", {})
                       .get("spool_pending") or {}).values())
        if (pending == 0 and expected <= set(mine)) or time.monotonic() > deadline:
            return mine
        time.sleep(1.0)


@pytest.mark.parametrize("run", range(1, RUNS + 1))
def test_chaos_under_load_loses_no_request_and_no_record(deployed: Cluster, http: httpx.Client, run: int) -> None:
    _wait_serving(http)
    load = Load(deployed.base_url, {"Authorization": f"Bearer {deployed.secrets.api_key}"}, rate=0.3,
                duration_s=110.0, seed=1000 + run)
    faults: list[tuple[float, str]] = []
    t0 = time.monotonic()
    load.start()

    def at(t: float, what: str, fn: Any) -> None:
        time.sleep(max(0.0, t0 + t - time.monotonic()))
        fn()
        faults.append((time.monotonic() - t0, what))

    at(10, "policy actor", _kill_policy_actor)
    at(25, "AuditLog replica", lambda: kill_replica("AuditLog"))
    at(40, "policy actor", _kill_policy_actor)
    model_killed = time.monotonic()
    at(55, "VLLMModel replica", lambda: kill_replica("VLLMModel"))
    model_died = time.monotonic()  # `kill_replica("VLLMModel")` has returned
    in_flight_at_kill = sum(1 for o in load.outcomes if o.sent_at <= model_killed and o.ended_at is None)
    load.join(timeout_s=300)
    back_s = _wait_serving(http)

    outcomes = load.outcomes
    by_kind: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, []).append(o)
    summary = {k: len(v) for k, v in by_kind.items()}
    # Served while the model lived: from the model replica's death until its replacement has
    # started its engine (a minute here, two on a slower machine: past the load's end) every
    # request is refused, so the whole run's ok share measures the machine, not the service.
    before = [o for o in outcomes if o.sent_at < model_died]
    ok_before = sum(1 for o in before if o.kind == "ok")
    longest = max((o.ended_at - o.sent_at for o in outcomes if o.ended_at is not None), default=0.0)
    report = (f"run {run}: {summary}; sent before the model replica was killed: {len(before)}, "
              f"{ok_before} ok; faults {faults}; longest answer {longest:.1f} s; "
              f"answering again {back_s:.0f} s after the load")
    # After the model replica died: the requests that waited their whole deadline for a replica
    # (503 expired), and those the ingress refused at once because it knew the model was down.
    after = [o for o in outcomes if o.sent_at >= model_died and o.kind == "refused"]
    expired = [o for o in after if "before its deadline" in o.detail]
    down = [o for o in after if "model is unavailable" in o.detail]
    report += (f"; after the kill: {len(expired)} expired, {len(down)} refused as the model is down "
               f"(longest {max((o.ended_at - o.sent_at for o in down), default=0.0):.2f} s)")
    print(report)
    assert len(outcomes) >= 20, report
    assert not by_kind.get("failed"), (report, [(o.rid, o.status, o.detail) for o in by_kind["failed"]][:10])
    broken_streams = by_kind.get("stream_error", [])
    assert len(broken_streams) <= max(1, in_flight_at_kill), (report, [(o.rid, o.detail) for o in broken_streams])
    assert ok_before >= len(before) // 2, report  # the load was served, not just refused
    slow = [(o.rid, o.kind, o.status, round(o.ended_at - o.sent_at, 1)) for o in outcomes
            if o.ended_at is not None and o.ended_at - o.sent_at > PROMPT_S]
    assert not slow, (report, slow[:10])
    # One expiry tells the ingress (`ModelHealth.observe_expired`: nothing has answered for as
    # long as the request waited): from then until a replica answers again, requests are refused
    # at once instead of each after its deadline. Before this, every request sent during the
    # outage waited its whole deadline (18 of 19 in one run on the 2-core AVX2 EPYC).
    if expired:
        known_at = min(o.ended_at for o in expired if o.ended_at is not None) + 1.0
        back_at = min((o.sent_at for o in outcomes if o.kind == "ok" and o.sent_at > model_died), default=float("inf"))
        waited = [(o.rid, round(o.sent_at - model_died, 1)) for o in expired if known_at <= o.sent_at < back_at]
        assert not waited, (report, waited[:10])

    sent = {o.rid for o in outcomes}
    audited = _audited(deployed, http, sent, {o.rid for o in by_kind.get("ok", [])})
    dup = sorted({i for i in audited if audited.count(i) > 1})
    assert not dup, f"audited twice: {dup[:5]}"
    missing = sorted(o.rid for o in by_kind.get("ok", []) if o.rid not in audited)
    assert not missing, f"{len(missing)} answered requests have no audit record: {missing[:5]} ({report})"
    assert set(audited) <= sent
