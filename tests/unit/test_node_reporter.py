"""A replica's report to its node's reporter as a datagram (deployments/node_reporter.py): the
codec, the reporter's receiving socket and the replica's link, with real Unix sockets and a
fake actor handle in place of the Ray calls (no Ray here)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from typing import Any

import pytest

from deployments.node_reporter import (
    MAX_DATAGRAM,
    NodeReportLink,
    ReportSocket,
    decode_report,
    encode_report,
    sockets_supported,
)

pytestmark = pytest.mark.skipif(not sockets_supported(), reason="abstract Unix datagram sockets are Linux's")


class Method:
    def __init__(self, owner: FakeReporter, name: str) -> None:
        self.owner, self.name = owner, name

    def remote(self, *args: Any) -> asyncio.Future:
        self.owner.calls.append((self.name, args))
        fut = asyncio.get_running_loop().create_future()
        if self.owner.dead:
            err = type("ActorDiedError", (Exception,), {})("the reporter died")
            fut.set_exception(err)
        else:
            fut.set_result(self.owner.answer(self.name, args))
        return fut


class FakeReporter:
    """A node reporter as its handle answers: ``address`` (its socket's, or None) and ``report``."""

    def __init__(self, take: list[tuple[str, dict, list]], with_socket: bool = True) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.dead = False
        self.taken = take
        self.socket = ReportSocket(lambda s, g, x: take.append((s, g, x)), f"test-reporter-{uuid.uuid4().hex}") \
            if with_socket else None

    def answer(self, method: str, args: tuple) -> Any:
        if method == "address":
            return None if self.socket is None else self.socket.address
        if method == "report":
            source, signals, stale = args
            self.taken.append((source, signals, stale))
            return True
        raise AttributeError(method)

    def __getattr__(self, name: str) -> Method:
        if name in ("address", "report"):
            return Method(self, name)
        raise AttributeError(name)


# -- the codec ------------------------------------------------------------------------------------


def test_a_report_survives_the_datagram() -> None:
    data = encode_report("VLLMModel:abc", {"queue_length": 3, "kv_cache_usage": 0.25}, ["gpu_util"], sent_at=12.5)
    assert decode_report(data) == ("VLLMModel:abc", {"queue_length": 3.0, "kv_cache_usage": 0.25}, ["gpu_util"], 12.5)
    assert len(data) < 200


@pytest.mark.parametrize("doc, field", [
    ({"g": {}, "t": 1.0}, "source 's'"),
    ({"s": "", "g": {}, "t": 1.0}, "source 's'"),
    ({"s": "a", "g": [1], "t": 1.0}, "signals 'g'"),
    ({"s": "a", "g": {"q": "3"}, "t": 1.0}, "signals 'g'"),
    ({"s": "a", "g": {"q": True}, "t": 1.0}, "signals 'g'"),
    ({"s": "a", "g": {}, "x": "gpu_util", "t": 1.0}, "stale 'x'"),
    ({"s": "a", "g": {}}, "sent time 't'"),
    ({"s": "a", "g": {}, "t": "now"}, "sent time 't'"),
])
def test_a_datagram_that_is_not_a_report_is_named(doc: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        decode_report(json.dumps(doc).encode())


@pytest.mark.parametrize("data", [b"\xff\xfe", b"not json", b"[1, 2]"])
def test_bytes_that_are_not_json_objects_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_report(data)


# -- the socket and the link ------------------------------------------------------------------------


async def _settle(sock: ReportSocket, taken: list, n: int, timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(taken) < n and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


def test_reports_go_as_datagrams_once_the_address_is_known() -> None:
    taken: list[tuple[str, dict, list]] = []

    async def go() -> tuple[FakeReporter, NodeReportLink]:
        reporter = FakeReporter(taken)
        reporter.socket.start()
        link = NodeReportLink(lambda: reporter)
        for i in range(5):
            assert await link.call("report", "Ingress:r1", {"inflight": float(i)}, ["p95_latency_ms"] if i == 4 else None)
        await _settle(reporter.socket, taken, 5)
        reporter.socket.close()
        link.close()
        return reporter, link

    reporter, link = asyncio.run(go())
    # one Ray call, for the address; the reports themselves went by datagram, in order
    assert [name for name, _ in reporter.calls] == ["address"]
    assert taken == [("Ingress:r1", {"inflight": float(i)}, ["p95_latency_ms"] if i == 4 else []) for i in range(5)]
    assert link.state()["datagrams"] == 5 and link.state()["ray_calls"] == 0
    counters = reporter.socket.counters()
    assert counters["received"] == 5 and counters["refused"] == counters["malformed"] == 0
    assert counters["address"].startswith("@test-reporter-")
    assert len(reporter.socket.delivery) == 5 and all(ms >= 0 for _, ms in reporter.socket.delivery)


def test_a_replaced_reporter_gets_the_report_by_ray_call_then_by_datagram() -> None:
    taken: list[tuple[str, dict, list]] = []
    reporters: list[FakeReporter] = []

    def resolve() -> FakeReporter:  # get_or_create_node_reporter: a new one once the old is gone
        if not reporters or reporters[-1].dead:
            reporters.append(FakeReporter(taken))
            reporters[-1].socket.start()
        return reporters[-1]

    async def go() -> NodeReportLink:
        link = NodeReportLink(resolve)
        assert await link.call("report", "VLLMModel:m", {"queue_length": 1.0})
        await _settle(reporters[0].socket, taken, 1)
        reporters[0].dead = True  # its process ends: its socket with it
        reporters[0].socket.close()
        assert await link.call("report", "VLLMModel:m", {"queue_length": 2.0})  # no one at the address
        assert await link.call("report", "VLLMModel:m", {"queue_length": 3.0})
        await _settle(reporters[1].socket, taken, 3)
        reporters[1].socket.close()
        link.close()
        return link

    link = asyncio.run(go())
    assert [g["queue_length"] for _, g, _ in taken] == [1.0, 2.0, 3.0]  # none lost
    assert len(reporters) == 2
    # the second went as a Ray call to the new reporter, which then gave its address
    assert [name for name, _ in reporters[1].calls] == ["report", "address"]
    assert link.state()["fallbacks"] == 1 and link.state()["datagrams"] == 2


def test_without_a_socket_every_report_is_a_ray_call() -> None:
    taken: list[tuple[str, dict, list]] = []
    reporter = FakeReporter(taken, with_socket=False)

    async def go() -> NodeReportLink:
        link = NodeReportLink(lambda: reporter)
        for i in range(3):
            assert await link.call("report", "Host:h", {"enrichment_p95_latency_ms": float(i)})
        return link

    link = asyncio.run(go())
    assert [name for name, _ in reporter.calls] == ["address", "report", "report", "report"]
    assert len(taken) == 3 and link.state()["datagrams"] == 0 and link.state()["fallbacks"] == 3


def test_a_full_queue_sends_the_report_by_ray_call() -> None:
    """The reporter's loop does not drain (never started): once its queue is full the datagram
    cannot be queued, and that report waits its turn as a Ray call instead of being lost."""
    taken: list[tuple[str, dict, list]] = []
    reporter = FakeReporter(taken)

    async def go() -> NodeReportLink:
        link = NodeReportLink(lambda: reporter)
        for i in range(2000):
            await link.call("report", "Ingress:r", {"inflight": float(i)})
            if link.queue_full:
                break
        return link

    link = asyncio.run(go())
    assert link.queue_full == 1, link.state()
    assert [name for name, _ in reporter.calls] == ["address", "report"]
    assert taken[-1][1]["inflight"] == float(link.sent)  # the one that did not fit, by Ray call
    assert reporter.socket.drain() == link.sent  # and every datagram queued before it arrives
    reporter.socket.close()


def test_malformed_and_oversized_datagrams_are_counted_and_dropped() -> None:
    taken: list[tuple[str, dict, list]] = []
    sock = ReportSocket(lambda s, g, x: taken.append((s, g, x)), f"test-reporter-{uuid.uuid4().hex}")
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        out.sendto(b"not json", sock.address)
        out.sendto(json.dumps({"s": "a", "g": {"q": "x"}, "t": 1.0}).encode(), sock.address)
        out.sendto(b"{" + b" " * MAX_DATAGRAM + b"}", sock.address)
        out.sendto(encode_report("Ingress:ok", {"inflight": 1.0}), sock.address)
        assert sock.drain() == 1
    finally:
        out.close()
        sock.close()
    assert taken == [("Ingress:ok", {"inflight": 1.0}, [])]
    assert sock.counters()["malformed"] == 3 and sock.counters()["received"] == 4


def test_a_datagram_from_another_user_is_refused() -> None:
    """The kernel's credentials decide: the socket here expects a uid that is not the sender's."""
    taken: list[tuple[str, dict, list]] = []
    sock = ReportSocket(lambda s, g, x: taken.append((s, g, x)), f"test-reporter-{uuid.uuid4().hex}")
    sock._uid = os.getuid() + 1  # as if the reporter ran as another user
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        out.sendto(encode_report("Ingress:x", {"inflight": 99.0}), sock.address)
        assert sock.drain() == 0
    finally:
        out.close()
        sock.close()
    assert taken == [] and sock.counters()["refused"] == 1
