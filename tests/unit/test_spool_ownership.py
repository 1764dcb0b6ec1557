"""DurableSpool ownership: one writer per file (flock), adoption of orphans, the size cap, group
commit, recovery off the event loop, and records that JSON cannot hold.

Processes are real (multiprocessing, fork): a flock is released by the kernel when its process
dies, which is exactly what a scaled-down or crashed replica does.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest

from deployments.enrichments import spool as spool_mod
from deployments.enrichments.spool import DurableSpool, SpoolFull, Unencodable, encode_record, sanitize

CTX = mp.get_context("fork")


async def collect(spool: DurableSpool, batch: int = 64) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    async def sink(records: list[dict[str, Any]]) -> None:
        out.extend(records)

    await spool.drain(batch, sink)
    return out


def _writer(directory: str, name: str, who: str, n: int, start: Any, die: bool) -> None:
    """A replica: owns ``name`` if it can, appends ``n`` records, then exits (or dies, no close)."""
    start.wait(10)
    spool = DurableSpool(Path(directory), name)
    for i in range(n):
        spool.append({"who": who, "i": i, "used": spool.name})
    if die:
        os._exit(0)  # a crash: no close; the kernel releases the lock
    spool.close()


def _holder(directory: str, name: str, ready: Any, release: Any) -> None:
    """A live replica: holds its spool (one pending record) until told to stop."""
    spool = DurableSpool(Path(directory), name)
    spool.append({"who": "live", "i": 0})
    ready.set()
    release.wait(20)
    spool.close()


def _adopter(directory: str, name: str, out: str, start: Any) -> None:
    """A replica that adopts the family's orphans and drains them to its own file of results."""
    start.wait(10)
    spool = DurableSpool(Path(directory), name)
    spool.adopt_orphans("audit_log")
    got = asyncio.run(collect(spool, 7))
    Path(out).write_text(json.dumps(got))
    spool.close()


def run_procs(procs: list[Any], go: Any = None) -> None:
    """Start the processes, release them together with ``go`` (an Event) if given, and wait for
    each to succeed."""
    for p in procs:
        p.start()
    if go is not None:
        go.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, p.exitcode


def test_two_live_writers_on_one_name_never_share_a_file(tmp_path: Path) -> None:
    """Two replicas racing with the same rank-based name: each writes its own file, nothing is
    lost, nothing is duplicated, each writer's order is kept."""
    start = CTX.Event()
    run_procs([CTX.Process(target=_writer, args=(str(tmp_path), "audit_log-ingress0", who, 300, start, False))
              for who in ("a", "b")], start)
    files = sorted(p.name for p in tmp_path.glob("*.spool"))
    # if they overlapped in time, the second owner wrote a file of its own
    assert files[0] == "audit_log-ingress0.spool" and len(files) in (1, 2)
    spool = DurableSpool(tmp_path, "audit_log-ingress0")
    spool.adopt_orphans("audit_log")
    got = asyncio.run(collect(spool))
    assert len(got) == 600 and spool.pending() == 0
    for who in ("a", "b"):
        assert [r["i"] for r in got if r["who"] == who] == list(range(300))
    # every line of one file came from one writer
    for used in {r["used"] for r in got}:
        assert len({r["who"] for r in got if r["used"] == used}) == 1


def test_a_live_twin_gets_its_own_file_and_the_collision_is_counted(tmp_path: Path) -> None:
    ready, release = CTX.Event(), CTX.Event()
    holder = CTX.Process(target=_holder, args=(str(tmp_path), "q", ready, release))
    holder.start()
    try:
        assert ready.wait(10)
        mine = DurableSpool(tmp_path, "q")
        assert mine.name.startswith("q@") and mine.stats()["name_collisions"] == 1
        mine.append({"who": "me"})
        assert mine.adopt_orphans() == 0  # the live holder's file is not an orphan
        assert asyncio.run(collect(mine)) == [{"who": "me"}]
    finally:
        release.set()
        holder.join(10)
    assert mine.adopt_orphans() == 1  # its owner is gone now
    assert asyncio.run(collect(mine)) == [{"who": "live", "i": 0}]
    mine.close()
    # the drained orphan is deleted; our own empty collision file too
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_orphans_of_a_crashed_replica_are_adopted_and_drained_first(tmp_path: Path) -> None:
    start = CTX.Event()
    start.set()
    run_procs([CTX.Process(target=_writer, args=(str(tmp_path), "audit_log-ingress2", "gone", 5, start, True))])
    survivor = DurableSpool(tmp_path, "audit_log-ingress0")
    survivor.append({"who": "me", "i": 0})
    other = DurableSpool(tmp_path, "feature_stats-ingress2")  # another family: never adopted here
    other.append({"who": "stats"})
    other.close()
    assert survivor.adopt_orphans("audit_log") == 5
    assert survivor.pending() == 6 and survivor.stats()["adopted_files"] == 1
    got = asyncio.run(collect(survivor, 2))
    assert [(r["who"], r["i"]) for r in got] == [("gone", i) for i in range(5)] + [("me", 0)]
    assert not (tmp_path / "audit_log-ingress2.spool").exists()
    assert not (tmp_path / "audit_log-ingress2.offset").exists()
    assert (tmp_path / "feature_stats-ingress2.spool").exists()


def test_an_adopted_spool_whose_drain_failed_stays_and_is_adopted_again(tmp_path: Path) -> None:
    start = CTX.Event()
    start.set()
    run_procs([CTX.Process(target=_writer, args=(str(tmp_path), "audit_log-ingress1", "gone", 4, start, True))])
    a = DurableSpool(tmp_path, "audit_log-ingress0")
    a.adopt_orphans("audit_log")
    delivered: list[int] = []

    async def fails_second(records: list[dict[str, Any]]) -> None:
        if delivered:
            raise ConnectionError("sink down")
        delivered.extend(r["i"] for r in records)

    with pytest.raises(ConnectionError):
        asyncio.run(a.drain(2, fails_second))
    a.close()  # this replica goes too: the adopted file is an orphan again, offset committed
    b = DurableSpool(tmp_path, "audit_log-ingress5")
    assert b.adopt_orphans("audit_log") == 2  # the two not yet delivered
    assert [r["i"] for r in asyncio.run(collect(b))] == [2, 3]


def test_two_adopters_racing_deliver_each_orphaned_record_once(tmp_path: Path) -> None:
    start = CTX.Event()
    start.set()
    run_procs([CTX.Process(target=_writer, args=(str(tmp_path), f"audit_log-ingress{r}", f"r{r}", 40, start, True))
               for r in range(4)])
    go = CTX.Event()
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    run_procs([CTX.Process(target=_adopter, args=(str(tmp_path / "."), f"audit_log-new{i}", str(outs[i]), go))
              for i in range(2)], go)
    got = [r for o in outs for r in json.loads(o.read_text())]
    assert sorted((r["who"], r["i"]) for r in got) == sorted((f"r{r}", i) for r in range(4) for i in range(40))
    assert not list(tmp_path.glob("audit_log-ingress*"))


def test_a_torn_tail_in_an_orphan_is_dropped_and_counted(tmp_path: Path) -> None:
    (tmp_path / "audit_log-ingress3.spool").write_bytes(b'{"i":0}\n{"i":1}\n{"i":')
    mine = DurableSpool(tmp_path, "audit_log-ingress0")
    assert mine.adopt_orphans("audit_log") == 2
    assert mine.stats()["torn_tails_dropped"] == 1
    assert asyncio.run(collect(mine)) == [{"i": 0}, {"i": 1}]


def test_in_one_process_handles_on_one_file_share_one_writer(tmp_path: Path) -> None:
    a = DurableSpool(tmp_path, "q")
    b = DurableSpool(tmp_path, "q")
    a.append({"i": 0})
    b.append({"i": 1})
    assert a.name == b.name == "q" and a.pending() == b.pending() == 2
    a.close()
    assert asyncio.run(collect(b)) == [{"i": 0}, {"i": 1}]  # b still holds the file
    b.close()


# -- cap -----------------------------------------------------------------------------------------


def test_the_cap_refuses_new_records_counted_and_writes_nothing(tmp_path: Path) -> None:
    line = len(encode_record({"i": 0}))
    spool = DurableSpool(tmp_path, "q", max_bytes=3 * line)
    for i in range(3):
        spool.append({"i": i})
    with pytest.raises(SpoolFull, match=r"max_bytes=\d+"):
        spool.append({"i": 3})
    with pytest.raises(SpoolFull):
        spool.append_many([{"i": 3}])

    async def submit_full() -> None:
        with pytest.raises(SpoolFull):
            spool.submit({"i": 3})

    asyncio.run(submit_full())
    assert spool.stats()["refused_full"] == 3 and spool.pending() == 3
    assert spool.path.stat().st_size == 3 * line
    assert [r["i"] for r in asyncio.run(collect(spool))] == [0, 1, 2]
    spool.append({"i": 3})  # a drain that empties it makes room again
    assert spool.pending() == 1


def test_the_cap_counts_records_queued_for_the_next_group_commit(tmp_path: Path) -> None:
    line = len(encode_record({"i": 0}))
    spool = DurableSpool(tmp_path, "q", max_bytes=2 * line)

    async def scenario() -> None:
        f1, f2 = spool.submit({"i": 0}), spool.submit({"i": 1})
        with pytest.raises(SpoolFull):
            spool.submit({"i": 2})  # nothing on disk yet, but two are queued
        await asyncio.gather(f1, f2)

    asyncio.run(scenario())
    assert spool.pending() == 2 and spool.stats()["queued_bytes"] == 0


@pytest.mark.parametrize("bad", [0, -1])
def test_max_bytes_must_be_positive(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError, match=f"max_bytes must be >= 1, got {bad}"):
        DurableSpool(tmp_path, "q", max_bytes=bad)


# -- group commit, write errors, recovery ------------------------------------------------------


def test_concurrent_commits_share_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = DurableSpool(tmp_path, "q")
    spool.recover()
    real = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.02)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)

    async def scenario() -> None:
        await asyncio.gather(*(spool.commit({"i": i}) for i in range(50)))

    asyncio.run(scenario())
    assert spool.pending() == 50
    assert spool.stats()["fsyncs"] <= 3  # the first commit alone, then everyone who queued meanwhile
    assert [r["i"] for r in asyncio.run(collect(spool))] == list(range(50))


def test_a_failed_write_leaves_no_partial_line_and_fails_every_waiter(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    spool = DurableSpool(tmp_path, "q")
    spool.append({"i": 0})
    size = spool.path.stat().st_size
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))

    async def scenario() -> list[Any]:
        return await asyncio.gather(spool.commit({"i": 1}), spool.commit({"i": 2}), return_exceptions=True)

    results = asyncio.run(scenario())
    assert all(isinstance(r, OSError) for r in results)
    monkeypatch.setattr(os, "fsync", real)
    assert spool.path.stat().st_size == size and spool.pending() == 1
    assert spool.stats()["write_errors"] >= 1
    spool.append({"i": 3})
    assert [r["i"] for r in asyncio.run(collect(spool))] == [0, 3]


def test_recovery_counts_lines_across_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spool_mod, "_CHUNK", 7)  # smaller than a line: every read splits one
    spool = DurableSpool(tmp_path, "q")
    for i in range(30):
        spool.append({"i": i, "pad": "x" * (i % 5)})
    keep = _Keep()
    assert asyncio.run(spool.drain(4, keep)) == 30
    assert [r["i"] for r in keep.records] == list(range(30))
    spool.close()
    spool = DurableSpool(tmp_path, "q")
    for i in range(12):
        spool.append({"i": i})
    spool.close()
    with open(tmp_path / "q.spool", "ab") as f:
        f.write(b'{"i": 12, "torn')
    again = DurableSpool(tmp_path, "q")
    again.recover()
    assert again.pending() == 12
    assert [r["i"] for r in asyncio.run(collect(again, 5))] == list(range(12))


class _Keep:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    async def __call__(self, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)


def test_open_recovers_in_a_thread_while_the_event_loop_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spool = DurableSpool(tmp_path, "q")
    for i in range(3):
        spool.append({"i": i})
    spool.close()
    real = spool_mod._count_lines

    def slow_count(fd: int, start: int, end: int) -> int:
        time.sleep(0.5)  # a huge spool
        return real(fd, start, end)

    monkeypatch.setattr(spool_mod, "_count_lines", slow_count)

    async def scenario() -> tuple[int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        opened = await DurableSpool.open(tmp_path, "q")
        t.cancel()
        return ticks, opened.pending()

    ticks, pending = asyncio.run(scenario())
    assert pending == 3 and ticks >= 10  # the loop kept running through the recovery


# -- encoding ------------------------------------------------------------------------------------


def _circular() -> dict[str, Any]:
    d: dict[str, Any] = {}
    d["self"] = d
    return d


@pytest.mark.parametrize("record, reason", [
    ({"x": {1, 2}}, "not_json:set"),
    ({"x": object()}, "not_json:object"),
    ({"x": float("nan")}, "not_json:non_finite_float"),
    ({"x": float("inf")}, "not_json:non_finite_float"),
    (_circular(), "circular"),
])
def test_records_json_cannot_hold_are_rejected_with_a_content_free_reason(record: Any, reason: str) -> None:
    with pytest.raises(Unencodable) as err:
        encode_record(record)
    assert err.value.reason == reason


def test_a_lone_surrogate_is_escaped_and_read_back(tmp_path: Path) -> None:
    line = encode_record({"t": "a\ud800b"})
    assert b"\\ud800" in line and json.loads(line) == {"t": "a\ud800b"}


@pytest.mark.parametrize("value, expected, escaped", [
    ({"a": 1, "b": [1.5, "x", None, True]}, {"a": 1, "b": [1.5, "x", None, True]}, 0),
    ({"a": float("nan")}, {"a": "nan"}, 1),
    ({"a": float("-inf")}, {"a": "-inf"}, 1),
    ({"a": {1, 2}}, {"a": {"$unencodable": "set"}}, 1),
    ({"a": b"bytes"}, {"a": {"$unencodable": "bytes"}}, 1),
    ({1: "x", None: "y"}, {"1": "x", "None": "y"}, 2),
    ({"t": ("a", "b")}, {"t": ["a", "b"]}, 0),
    ({"s": "\ud800"}, {"s": "\ud800"}, 0),
])
def test_sanitize_escapes_what_json_cannot_hold(value: Any, expected: Any, escaped: int) -> None:
    out, n = sanitize(value)
    assert out == expected and n == escaped
    encode_record(out)  # always encodable afterwards


def test_sanitize_cuts_deep_nesting_and_cycles() -> None:
    deep: Any = "leaf"
    for _ in range(5000):
        deep = [deep]
    out, n = sanitize({"deep": deep})
    assert n == 1 and len(encode_record(out)) < 1000
    out, n = sanitize(_circular())
    assert n == 1
    encode_record(out)
