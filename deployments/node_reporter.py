"""One reporter per Ray node: the node's replicas report to it, and it sends their reports on to
the policy actor in batches (issue 14: reports batched per node).

Every replica (model, enrichment host, ingress) sends its signals with `signal_reporter` to the
`NodeReporter` of the node it runs on (`report_link`), a datagram on the node (below); the reporter's
`deployments.reporting.ReportBatcher` sends them on with ``report_batch``: routine reports at most
once per 0.5 s per node, a report that may raise the level at once. At a thousand replicas on a
hundred nodes the policy actor then answers at most two calls a second per node instead of four
per replica (`bench/policy_scale.py`, bench/POLICY_SCALE.md).

The reporter is a detached actor named ``brownout-reporter-<node id>`` in namespace
``brownout``, pinned to its node (``NodeAffinitySchedulingStrategy``, not soft), using no CPU.
The first replica on a node creates it (``get_if_exists``), the others find it. It is not
restarted (``max_restarts=0``): when it dies, its node's replicas' links find it gone and
create it again on their next report; when its node dies, it dies with the node's replicas
and their reports go stale at the actor, as they would without it. Sources stay per replica,
so ``brownout_policy_sources`` and staleness mean what they meant.

How a report reaches the reporter: a datagram, not a Ray call. The reporter binds a Unix
datagram socket in Linux's abstract namespace (no file; gone with its process), named per
reporter incarnation, and tells a replica's link its address once (`NodeReporter.address`, a
Ray call). Each report is then one ``sendto`` of a small JSON datagram (`encode_report`) into
the reporter's receive queue: tens of microseconds of the replica's CPU and none of Ray's call
path, where a local Ray call costs milliseconds on both sides (bench/POLICY_SCALE.md). It is
not fire-and-forget into the void: the send returns once the kernel has queued the datagram
for the reporter's process, and fails at once when there is none:

- no reporter at the address (it died, or was replaced): the link resolves the reporter again
  (creating it, as before) and sends the report as a Ray call this once;
- the reporter's queue full (``net.unix.max_dgram_qlen`` datagrams waiting: its loop is stuck):
  that report goes as a Ray call, which waits its turn;
- no abstract Unix sockets (not Linux): every report is a Ray call, as before.

Only the reporter's own user may report: the socket receives the sender's credentials
(``SO_PASSCRED``) and a datagram from another uid is counted as refused and dropped (a Ray
call needs the cluster's token; a local socket must not be an easier way in). A datagram that
does not decode to a report is counted and dropped, never raised. The reporter times each
report's delivery (the sender's wall clock in the datagram to its arrival in the batcher, one
machine's clock): ``state()["delivery_ms"]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import struct
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from deployments.reporting import ActorLink, LinkBackoff, ReportBatcher, ThrottledLog, actor_gone

logger = logging.getLogger("ray.serve")

REPORTER_PREFIX = "brownout-reporter-"
MAX_DATAGRAM = 16384  # a report is a few hundred bytes; a larger datagram is refused
DELIVERY_SAMPLES = 8192  # the reporter keeps this many latest delivery times for state()
_UCRED = struct.Struct("iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid


def sockets_supported() -> bool:
    """Abstract-namespace Unix datagram sockets with sender credentials: Linux only."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PASSCRED") and hasattr(socket, "AF_UNIX")


def encode_report(source: str, signals: Mapping[str, float], stale: Sequence[str] = (),
                  sent_at: float | None = None) -> bytes:
    """One report as a datagram: JSON ``{"s": source, "g": signals, "x": stale, "t": wall time}``."""
    return json.dumps({"s": source, "g": dict(signals), "x": list(stale),
                       "t": time.time() if sent_at is None else sent_at}, separators=(",", ":")).encode()


def decode_report(data: bytes) -> tuple[str, dict[str, float], list[str], float]:
    """The inverse of `encode_report`; ValueError naming what is wrong with a datagram that is
    not a report. Values are checked for type only: the policy actor judges them."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"not JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not an object: {type(doc).__name__}")
    source, signals, stale, sent_at = doc.get("s"), doc.get("g"), doc.get("x", []), doc.get("t")
    if not isinstance(source, str) or not source:
        raise ValueError(f"source 's' must be a non-empty string, got {source!r}")
    if not isinstance(signals, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in signals.items()):
        raise ValueError(f"signals 'g' must map names to numbers, got {signals!r}")
    if not isinstance(stale, list) or not all(isinstance(k, str) for k in stale):
        raise ValueError(f"stale 'x' must be a list of names, got {stale!r}")
    if not isinstance(sent_at, (int, float)) or isinstance(sent_at, bool) or not math.isfinite(sent_at):
        raise ValueError(f"sent time 't' must be a finite number, got {sent_at!r}")
    return source, {k: float(v) for k, v in signals.items()}, stale, float(sent_at)


class ReportSocket:
    """The reporter's receiving end: a non-blocking abstract Unix datagram socket, drained on the
    event loop (``add_reader``) into ``take(source, signals, stale)``.

    Counts what it received, refused (another uid), found malformed; keeps the latest delivery
    times (arrival minus the sender's wall clock, ms) with their arrival times."""

    def __init__(self, take: Callable[[str, dict[str, float], list[str]], None], name: str,
                 clock: Callable[[], float] = time.time) -> None:
        self.take = take
        self.address = "\0" + name
        self._clock = clock
        self.received = self.refused = self.malformed = 0
        self.delivery: deque[tuple[float, float]] = deque(maxlen=DELIVERY_SAMPLES)
        self._uid = os.getuid()
        self._log = ThrottledLog(logger)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            self.sock.bind(self.address)
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self.drain)

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def drain(self) -> int:
        """Take every datagram waiting; returns how many were taken."""
        taken = 0
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(MAX_DATAGRAM + 1, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return taken
            except OSError as err:  # the socket closed under us: nothing more to take
                self._log.warning("report socket receive failed: %r", err)
                return taken
            self.received += 1
            uid = next((_UCRED.unpack(d[:_UCRED.size])[1] for level, kind, d in ancdata
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
                        and len(d) >= _UCRED.size), None)
            if uid != self._uid:
                self.refused += 1
                self._log.warning("report datagram from uid %s refused (the reporter runs as %s)", uid, self._uid)
                continue
            try:
                if len(data) > MAX_DATAGRAM:
                    raise ValueError(f"over {MAX_DATAGRAM} bytes")
                source, signals, stale, sent_at = decode_report(data)
            except ValueError as err:
                self.malformed += 1
                self._log.warning("malformed report datagram dropped: %s", err)
                continue
            self.take(source, signals, stale)
            now = self._clock()
            self.delivery.append((now, (now - sent_at) * 1000.0))
            taken += 1

    def counters(self) -> dict[str, Any]:
        return {"address": self.address.replace("\0", "@"), "received": self.received, "refused": self.refused,
                "malformed": self.malformed}


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class NodeReporter:
    """Takes reports from the replicas of one node and sends them on in batches."""

    def __init__(self, node_id: str, policy_actor: tuple[str, str] | None = None) -> None:
        """``policy_actor``: (name, namespace) of a policy actor other than the shipped one (the
        scale benchmark's); None: the app's, created if it is not there."""
        self.node_id = node_id
        self._policy_actor = policy_actor
        self._batcher: ReportBatcher | None = None
        self._socket: ReportSocket | None = None
        self._socket_error: str | None = None

    def _get_batcher(self) -> ReportBatcher:
        if self._batcher is None:  # made on the actor's event loop, where its sender task runs
            from policies.actor import get_or_create_policy_actor

            named = self._policy_actor
            resolve = get_or_create_policy_actor if named is None else (
                lambda: ray.get_actor(named[0], namespace=named[1]))
            self._batcher = ReportBatcher(ActorLink(resolve))
        return self._batcher

    async def report(self, source: str, signals: dict[str, float], stale: list[str] | None = None) -> bool:
        """Take ``source``'s report (as `policies.actor.PolicyActor.report`); True once it is taken,
        not once the actor has it (the actor counts what it rejects)."""
        self._get_batcher().put(source, signals, stale or ())
        return True

    async def address(self) -> str | None:
        """The address of this reporter's datagram socket (bound on the first ask), or None where
        reports must come as Ray calls (no abstract Unix sockets, or binding failed: logged)."""
        if self._socket is None and self._socket_error is None:
            if not sockets_supported():
                self._socket_error = f"no abstract Unix datagram sockets on {sys.platform}"
            else:
                batcher = self._get_batcher()
                try:
                    self._socket = ReportSocket(batcher.put, f"{reporter_name(self.node_id)}-{uuid.uuid4().hex[:12]}")
                    self._socket.start()
                except OSError as err:
                    self._socket = None
                    self._socket_error = f"binding the report socket failed: {err!r}"
                    logger.warning("node reporter %s: %s; replicas report by Ray call", self.node_id, self._socket_error)
        return None if self._socket is None else self._socket.address

    async def state(self) -> dict[str, Any]:
        sock = self._socket
        delivery = [ms for _, ms in sock.delivery] if sock is not None else []
        return {"node_id": self.node_id, **self._get_batcher().state(),
                "socket": sock.counters() if sock is not None else {"error": self._socket_error},
                "delivery_ms": {"n": len(delivery), "p50": _pct(delivery, 50), "p99": _pct(delivery, 99),
                                "max": round(max(delivery), 3) if delivery else None}}

    async def delivered_since(self, since: float) -> list[tuple[float, float]]:
        """(arrival wall time, delivery ms) of the datagram reports that arrived after ``since``
        (of the latest `DELIVERY_SAMPLES`): the scale benchmark's report figure."""
        return [] if self._socket is None else [(t, ms) for t, ms in self._socket.delivery if t >= since]


def _pct(values: Sequence[float], q: float) -> float | None:
    from deployments.window import percentile

    return round(percentile(values, q), 3) if values else None


def reporter_name(node_id: str) -> str:
    return f"{REPORTER_PREFIX}{node_id}"


def get_or_create_node_reporter(namespace: str | None = None, policy_actor: tuple[str, str] | None = None) -> Any:
    """This node's reporter, creating it if no replica on the node has yet. ``namespace`` and
    ``policy_actor`` (`NodeReporter`): the scale benchmark's own; None: the app's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from policies.actor import ACTOR_NAMESPACE

    node_id = ray.get_runtime_context().get_node_id()
    return NodeReporter.options(  # type: ignore[attr-defined]
        name=reporter_name(node_id), namespace=namespace or ACTOR_NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, policy_actor)


class NodeReportLink:
    """A replica's link to its node's reporter: each report a datagram to the reporter's socket,
    a Ray call where that cannot go (module docstring). ``call("report", source, signals,
    stale)`` as `ActorLink.call`, which it uses for the Ray calls (its time-outs, back-off and
    pending cap) and whose ``resolve`` it takes (``get_or_create_node_reporter``).

    ``state()`` for ``/admin/brownout``: the Ray link's counters, plus datagrams sent, reports
    that went as Ray calls and why (``fallbacks``: no socket known yet or the reporter gone;
    ``queue_full``), and the address in use."""

    def __init__(self, resolve: Callable[[], Any]) -> None:
        self.link = ActorLink(resolve)
        self._address: str | None = None
        self._ask = True  # ask the reporter for its address before the next report
        self._sock: socket.socket | None = None
        self.sent = self.fallbacks = self.queue_full = 0

    @property
    def failures(self) -> int:
        return self.link.failures

    @property
    def skipped(self) -> int:
        return self.link.skipped

    def state(self) -> dict[str, Any]:
        return {**self.link.state(), "datagrams": self.sent, "ray_calls": self.fallbacks + self.queue_full,
                "fallbacks": self.fallbacks, "queue_full": self.queue_full,
                "address": None if self._address is None else self._address.replace("\0", "@")}

    async def call(self, method: str, source: str, signals: Mapping[str, float], stale: Sequence[str] | None = None,
                   **kwargs: Any) -> Any:
        if method != "report":  # only reports travel by datagram
            return await self.link.call(method, source, signals, *(() if stale is None else (stale,)), **kwargs)
        if self._ask:
            await self._learn_address()
        if self._address is not None:
            try:
                self._socket().sendto(encode_report(source, signals, stale or ()), self._address)
                self.sent += 1
                return True
            except (BlockingIOError, InterruptedError):  # its queue is full: this one waits its turn
                self.queue_full += 1
            except OSError:  # nobody at the address: the reporter died or was replaced
                self._address, self._ask = None, True
                self.link.forget()  # resolve (re-create) the reporter before the Ray call
                self.fallbacks += 1
        else:
            self.fallbacks += 1
        return await self.link.call("report", source, dict(signals), list(stale or ()))

    async def _learn_address(self) -> None:
        try:
            self._address = await self.link.call("address")
            self._ask = False
        except LinkBackoff:
            self._address = None
        except Exception as err:  # noqa: BLE001 - counted by the link; the report goes as a Ray call
            self._address = None
            if not actor_gone(err):
                self._ask = False  # an old reporter without `address`: Ray calls from now on

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def report_link() -> NodeReportLink:
    """The link a replica reports through: to its node's reporter."""
    return NodeReportLink(get_or_create_node_reporter)
