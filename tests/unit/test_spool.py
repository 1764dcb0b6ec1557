"""DurableSpool: order, no loss across sink failures and restarts, at-least-once redelivery.

One writer per file, adoption of orphans, the size cap, group commit and encoding are in
tests/unit/test_spool_ownership.py."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.enrichments.spool import DurableSpool


def reopen(directory: Path, name: str) -> DurableSpool:
    """A replica restart: a new owner of the file, which it recovers (in a thread, in the service)."""
    spool = DurableSpool(directory, name)
    spool.recover()
    return spool


class Sink:
    """Accepts batches, or raises on the calls whose 1-based number is in ``fail_on``."""

    def __init__(self, fail_on: set[int] = frozenset()) -> None:
        self.fail_on = set(fail_on)
        self.calls = 0
        self.accepted: list[dict[str, Any]] = []
        self.batch_sizes: list[int] = []

    async def __call__(self, records: list[dict[str, Any]]) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            raise ConnectionError(f"sink down on call {self.calls}")
        self.accepted.extend(records)
        self.batch_sizes.append(len(records))


def recs(start: int, stop: int) -> list[dict[str, Any]]:
    return [{"seq": i, "request_id": f"r{i}"} for i in range(start, stop)]


def test_drains_in_order_in_batches_and_resets_the_file(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, "audit_log")
    for r in recs(0, 7):
        spool.append(r)
    assert spool.pending() == 7
    sink = Sink()
    assert asyncio.run(spool.drain(3, sink)) == 7
    assert sink.accepted == recs(0, 7)
    assert sink.batch_sizes == [3, 3, 1]
    assert spool.pending() == 0
    assert spool.path.stat().st_size == 0
    assert spool.offset_path.read_text() == "0"
    assert asyncio.run(spool.drain(3, sink)) == 0


def test_restart_and_failing_sink_lose_nothing_and_keep_order(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, "q")
    for r in recs(0, 10):
        spool.append(r)
    sink = Sink(fail_on={3})
    with pytest.raises(ConnectionError):
        asyncio.run(spool.drain(2, sink))
    assert sink.accepted == recs(0, 4)  # two batches committed, the third failed
    spool.close()

    restarted = reopen(tmp_path, "q")  # a replica restart
    assert restarted.pending() == 6
    for r in recs(10, 13):
        restarted.append(r)
    assert asyncio.run(restarted.drain(4, sink)) == 9
    assert sink.accepted == recs(0, 13)
    assert restarted.pending() == 0


def test_a_batch_the_sink_took_but_did_not_acknowledge_is_sent_again(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, "q")
    for r in recs(0, 4):
        spool.append(r)
    seen: list[int] = []

    async def takes_then_fails(records: list[dict[str, Any]]) -> None:
        seen.extend(r["seq"] for r in records)
        raise TimeoutError("acknowledgement lost")

    with pytest.raises(TimeoutError):
        asyncio.run(spool.drain(2, takes_then_fails))
    sink = Sink()
    spool.close()
    asyncio.run(reopen(tmp_path, "q").drain(2, sink))
    assert seen == [0, 1]
    assert [r["seq"] for r in sink.accepted] == [0, 1, 2, 3]  # at-least-once: 0 and 1 twice


def test_a_torn_final_line_is_dropped_on_restart(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, "q")
    for r in recs(0, 3):
        spool.append(r)
    spool.close()
    with open(spool.path, "ab") as f:
        f.write(b'{"seq": 3, "requ')  # died mid-append, before fsync returned
    restarted = reopen(tmp_path, "q")
    assert restarted.pending() == 3 and restarted.stats()["torn_tails_dropped"] == 1
    restarted.append(recs(3, 4)[0])
    sink = Sink()
    asyncio.run(restarted.drain(10, sink))
    assert sink.accepted == recs(0, 4)


def test_a_reset_interrupted_after_truncation_recovers(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, "q")
    for r in recs(0, 3):
        spool.append(r)
    asyncio.run(spool.drain(10, Sink()))
    spool.close()
    spool.offset_path.write_text("999")  # as if the process died between truncate and offset reset
    restarted = reopen(tmp_path, "q")
    assert restarted.pending() == 0
    restarted.append({"seq": 3})
    sink = Sink()
    asyncio.run(restarted.drain(10, sink))
    assert sink.accepted == [{"seq": 3}]


def test_concurrent_appends_from_threads_keep_each_threads_order(tmp_path: Path) -> None:
    spool = DurableSpool(tmp_path, "q")

    def producer(t: int) -> None:
        for i in range(50):
            spool.append({"t": t, "i": i})

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    sink = Sink()
    asyncio.run(spool.drain(64, sink))
    assert len(sink.accepted) == 400
    for t in range(8):
        assert [r["i"] for r in sink.accepted if r["t"] == t] == list(range(50))


@pytest.mark.parametrize(
    ("args", "match"),
    [(("bad/name",), "spool name"), (("..",), "spool name"), (("",), "spool name")],
)
def test_bad_names_are_rejected(tmp_path: Path, args: tuple[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DurableSpool(tmp_path, *args)


def test_batch_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        asyncio.run(DurableSpool(tmp_path, "q").drain(0, Sink()))


# Operations: ("append", n) appends n records; ("drain", batch, fail_on_call) drains with a sink
# that fails on that call (0: never); ("restart",) reopens the spool from disk.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 5)),
        st.tuples(st.just("drain"), st.integers(1, 4), st.integers(0, 3)),
        st.tuples(st.just("restart")),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops)
def test_whatever_happens_every_record_comes_out_once_in_order(ops: list[tuple]) -> None:
    with tempfile.TemporaryDirectory() as d:
        spool = DurableSpool(Path(d), "q")
        appended = accepted = 0
        out: list[int] = []
        for op in ops:
            if op[0] == "append":
                for _ in range(op[1]):
                    spool.append({"seq": appended})
                    appended += 1
            elif op[0] == "drain":
                sink = Sink(fail_on={op[2]} if op[2] else set())
                try:
                    asyncio.run(spool.drain(op[1], sink))
                except ConnectionError:
                    pass
                out.extend(r["seq"] for r in sink.accepted)
            else:
                spool.close()
                spool = reopen(Path(d), "q")
            accepted = len(out)
            assert spool.pending() == appended - accepted
        final = Sink()
        asyncio.run(spool.drain(7, final))
        out.extend(r["seq"] for r in final.accepted)
        spool.close()
        assert out == list(range(appended))
