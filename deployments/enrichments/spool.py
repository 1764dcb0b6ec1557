"""DurableSpool: a crash-safe FIFO of JSON records, for the ``defer`` off-mode, one writer per file.

While a deferred feature is off, its work is appended here; once the level allows it again,
`drain` hands the records to the real sink, in the order they were appended.

On disk, for ``name``: ``{name}.spool`` holds one JSON line per record and ``{name}.offset`` the
byte offset up to which records have been delivered (the committed offset). An append writes its
lines, then fsyncs, before it returns (or its future resolves). `drain` reads a batch from the
committed offset, awaits ``sink(batch)`` and only then moves the offset forward, by writing a
temporary file, fsyncing it and renaming it over the old one, so the offset file always holds
either the old or the new value. When a drain leaves nothing pending the spool file is truncated
and the offset reset to 0, so the file only grows while a backlog exists.

One writer per spool file. The owner holds ``fcntl.flock(LOCK_EX)`` on the ``.spool`` file itself
(the data file is the lock file: no third file, and a lock on a separate file could not follow a
spool that is moved) for the life of the owner; the kernel releases it when the process dies,
however it dies. Consequences:

- Opening a name that a live process holds does not share it: the new owner writes
  ``{name}@{pid}-{random}.spool`` instead (counted ``name_collisions``). Ray renumbers replica
  ranks on scale-down, so a caller that names spools by rank can meet a live twin; it never
  writes into its file.
- Inside one process, every `DurableSpool` on one file is a handle on ONE shared state (one
  lock, one offset), so there is still a single writer.
- A spool file nobody holds is an orphan (its owner stopped or died). `adopt_orphans(family)`
  locks every orphan whose name is ``family`` or starts with ``family-`` (or ``family@``); once
  held, they are drained before the owner's own records, and deleted once empty. Two replicas
  racing for one orphan: the lock lets one win; the loser skips it. A file deleted between a
  rival's ``open`` and its lock is detected (inode check) and skipped.
- A restarted replica that gets the same name back simply locks and recovers its old file.

Recovery (`recover`, `adopt_orphans`) reads incrementally, in 1 MiB chunks, and never more than
it needs: a final line without its newline (an append that died before its fsync returned, so it
was never acknowledged) is truncated away and counted; pending records are counted by newline.
Both are blocking; call them through ``asyncio.to_thread`` (`open_spool` does) so the event loop
never waits on a large spool. Constructing a `DurableSpool` only takes the lock.

Size cap: ``max_bytes`` bounds the bytes of the owner's own file plus the bytes queued to be
written. An append that would pass it raises `SpoolFull` (counted ``refused_full``); the caller
decides what refusing means (the pipeline counts ``spool_full`` and does not promise the record).
Adopted orphans do not count: they only shrink.

Group commit: `submit` (from the event loop) queues a line and returns a future; one flusher
writes everything queued, fsyncs ONCE, and resolves every future of that batch, so concurrent
appends share an fsync. `append` / `append_many` are the blocking equivalents for threads.

Delivery is at-least-once: if the sink raises, or the process dies after the sink succeeded but
before the offset was committed, that batch is sent again by the next drain. Sinks that must not
see a record twice deduplicate on its ``record_id`` (the audit log does).

Records hold prompts and answers, so every file here is private: the folder is 0700 and each file
0600 from the moment it is created, whatever the process's umask (`private_dir`, `open_private`,
which the other enrichments that write files use too).
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import math
import os
import re
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
SUFFIX = ".spool"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
_CHUNK = 1 << 20


class SpoolFull(Exception):
    """An append would take the spool past its ``max_bytes``: nothing was written."""


class Unencodable(ValueError):
    """A record that cannot be one JSON line; ``reason`` is content-free (it is logged and counted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Segment:
    """One locked spool file: the owner's own, or an adopted orphan."""

    path: Path
    fd: int  # O_RDWR, flock'd: reads, writes and the lock all go through it
    offset: int = 0
    pending: int = 0
    size: int = 0
    recovered: bool = False

    @property
    def offset_path(self) -> Path:
        return self.path.with_name(self.path.name[: -len(SUFFIX)] + ".offset")


def owner_token() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:10]}"


def _try_lock(path: Path, create: bool) -> int | None:
    """An fd holding ``flock(LOCK_EX)`` on ``path``, or None if a live owner holds it (or it is gone)."""
    for _ in range(5):
        try:
            fd = open_private(path, os.O_RDWR) if create else os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            if not create:
                os.fchmod(fd, PRIVATE_FILE_MODE)
            return fd
        os.close(fd)  # deleted (or replaced) between our open and our lock: look again
        if not create:
            return None
    return None


class _Core:
    """The state every `DurableSpool` handle on one file shares (see the module docstring)."""

    def __init__(self, directory: Path, name: str, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.requested = name
        self.collisions = 0
        fd = _try_lock(directory / f"{name}{SUFFIX}", create=True)
        while fd is None:
            self.collisions += 1
            log.warning("spool %s is held by a live owner; writing a file of our own instead", name)
            name = f"{self.requested}@{owner_token()}"
            fd = _try_lock(directory / f"{name}{SUFFIX}", create=True)
        self.name = name
        self.own = _Segment(directory / f"{name}{SUFFIX}", fd)
        if self.own.offset_path.exists():
            os.chmod(self.own.offset_path, PRIVATE_FILE_MODE)  # written before files were private
        self.adopted: list[_Segment] = []
        self.lock = threading.Lock()  # the files, offsets and counters
        self.drain_lock = asyncio.Lock()  # one drain at a time
        self.refs = 0
        self.closed = False
        self.counts = {"appended": 0, "delivered": 0, "corrupt_skipped": 0, "refused_full": 0,
                       "torn_tails_dropped": 0, "adopted_files": 0, "adopted_records": 0, "fsyncs": 0,
                       "write_errors": 0}
        self.queue: list[tuple[bytes, asyncio.Future[None]]] = []
        self.queued_bytes = 0
        self.flusher: asyncio.Task[None] | None = None

    # -- recovery ------------------------------------------------------------------------------

    def recover(self) -> None:
        with self.lock:
            self._recover(self.own)

    def _recover(self, seg: _Segment) -> None:
        """Committed offset, torn tail dropped, pending counted: incremental reads, no whole file."""
        if seg.recovered:
            return
        size = os.fstat(seg.fd).st_size
        offset = 0
        try:
            offset = int(seg.offset_path.read_text().strip() or 0)
        except FileNotFoundError:
            pass
        except ValueError:
            log.error("spool %s: unreadable offset file; starting from 0 (records may repeat)", seg.path)
        end = _last_line_end(seg.fd, size)
        if end < size:
            # The last append died before its fsync returned, so it was never acknowledged.
            log.warning("spool %s: dropping a torn final line of %d bytes", seg.path, size - end)
            os.ftruncate(seg.fd, end)
            os.fsync(seg.fd)
            self.counts["torn_tails_dropped"] += 1
        if offset > end or offset < 0:
            # A reset truncated the file but died before writing offset 0.
            offset = 0
            _commit_offset(seg.offset_path, 0, self.directory)
        seg.offset, seg.size = offset, end
        seg.pending = _count_lines(seg.fd, offset, end)
        seg.recovered = True

    def adopt_orphans(self, family: str | None) -> int:
        """Lock and take over the orphaned spools of ``family``; return how many records came."""
        family = family or self.requested.split("@", 1)[0]
        adopted = 0
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            base = path.name[: -len(SUFFIX)]
            if not (base == family or base.startswith(family + "-") or base.startswith(family + "@")):
                continue
            with self.lock:
                if self.closed or path == self.own.path or any(s.path == path for s in self.adopted):
                    continue
            fd = _try_lock(path, create=False)
            if fd is None:
                continue  # a live owner (or a rival adopter) holds it
            seg = _Segment(path, fd)
            with self.lock:
                self._recover(seg)
                if seg.pending == 0:
                    self._retire(seg)
                    continue
                self.adopted.append(seg)
                self.counts["adopted_files"] += 1
                self.counts["adopted_records"] += seg.pending
                adopted += seg.pending
            log.info("spool %s: adopted an orphaned spool with %d records", self.name, seg.pending)
        return adopted

    def _retire(self, seg: _Segment) -> None:
        """Delete a drained adopted file. The offset goes first: a crash in between repeats records
        (the sink dedupes) rather than leaving an offset a later file of that name would misread."""
        for p in (seg.offset_path, seg.path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        fsync_dir(self.directory)
        os.close(seg.fd)  # releases the lock after the file is gone: a waiting rival finds no file
        if seg in self.adopted:
            self.adopted.remove(seg)

    # -- appends -------------------------------------------------------------------------------

    def pending(self) -> int:
        return self.own.pending + sum(s.pending for s in list(self.adopted))

    def _check_room(self, nbytes: int) -> None:
        if self.own.size + self.queued_bytes + nbytes > self.max_bytes:
            self.counts["refused_full"] += 1
            raise SpoolFull(f"spool {self.name} holds {self.own.size + self.queued_bytes} bytes; "
                            f"{nbytes} more would pass max_bytes={self.max_bytes}")

    def write(self, lines: list[bytes]) -> None:
        """Append ``lines`` and fsync once. Blocking; on failure nothing is left half-written."""
        data = b"".join(lines)
        with self.lock:
            if self.closed:
                raise RuntimeError(f"spool {self.name} is closed")
            self._recover(self.own)
            pos = os.fstat(self.own.fd).st_size
            try:
                view = memoryview(data)
                while view:
                    n = os.pwrite(self.own.fd, view, pos + len(data) - len(view))
                    view = view[n:]
                os.fsync(self.own.fd)
            except BaseException:
                self.counts["write_errors"] += 1
                try:
                    os.ftruncate(self.own.fd, pos)  # no partial line for the next append to corrupt
                except OSError:
                    pass
                raise
            self.own.size = pos + len(data)
            self.own.pending += len(lines)
            self.counts["appended"] += len(lines)
            self.counts["fsyncs"] += 1

    def submit(self, record: Any) -> asyncio.Future[None]:
        line = encode_record(record)
        with self.lock:
            self._check_room(len(line))
            self.queued_bytes += len(line)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.queue.append((line, fut))
        if self.flusher is None or self.flusher.done():
            self.flusher = loop.create_task(self._flush())
        return fut

    async def _flush(self) -> None:
        while self.queue:
            batch, self.queue = self.queue, []
            nbytes = sum(len(line) for line, _ in batch)
            try:
                await asyncio.to_thread(self.write, [line for line, _ in batch])
            except BaseException as err:  # every waiter learns its record was not written
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err if isinstance(err, Exception) else RuntimeError("spool flush cancelled"))
                if not isinstance(err, Exception):
                    raise
            else:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)
            finally:
                with self.lock:
                    self.queued_bytes -= nbytes

    # -- drain ---------------------------------------------------------------------------------

    def next_segment(self) -> _Segment:
        with self.lock:
            return self.adopted[0] if self.adopted else self.own

    def read(self, seg: _Segment, batch: int) -> tuple[list[dict[str, Any]], int, int]:
        """Up to ``batch`` records from ``seg``'s committed offset, the offset after them, lines read."""
        with self.lock:
            self._recover(seg)
            pos = seg.offset
            records: list[dict[str, Any]] = []
            lines = 0
            buf = b""
            while lines < batch:
                chunk = os.pread(seg.fd, _CHUNK, pos + len(buf))
                if not chunk:
                    break
                buf += chunk
                start = 0
                while lines < batch:
                    nl = buf.find(b"\n", start)
                    if nl < 0:
                        break
                    line = buf[start : nl + 1]
                    lines += 1
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        # Only disk corruption gets here; skipping it keeps the spool moving.
                        self.counts["corrupt_skipped"] += 1
                        log.error("spool %s: skipping a corrupt record at byte %d", seg.path, pos + start)
                    start = nl + 1
                pos += start
                buf = buf[start:]
            return records, pos, lines

    def advance(self, seg: _Segment, offset: int, lines: int) -> None:
        with self.lock:
            _commit_offset(seg.offset_path, offset, self.directory)
            seg.offset = offset
            seg.pending = max(0, seg.pending - lines)
            self.counts["delivered"] += lines

    def finish_segment(self, seg: _Segment) -> None:
        """``seg`` has nothing left: retire an adopted one, reset (truncate) our own."""
        with self.lock:
            if seg is not self.own:
                self._retire(seg)
                return
            if seg.pending or seg.offset == 0:
                return
            # Truncate first: if we die before the offset is reset, recovery sees offset > size.
            os.ftruncate(seg.fd, 0)
            os.fsync(seg.fd)
            _commit_offset(seg.offset_path, 0, self.directory)
            seg.offset = seg.size = 0

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for seg in list(self.adopted):
                os.close(seg.fd)  # still pending: an orphan again, for the next adopter
            self.adopted.clear()
            if "@" in self.name and self.own.recovered and self.own.pending == 0 and self.own.size == 0:
                for p in (self.own.offset_path, self.own.path):  # a collision file, empty: no litter
                    try:
                        p.unlink()
                    except FileNotFoundError:
                        pass
            os.close(self.own.fd)


_OPEN: dict[str, _Core] = {}  # resolved path of the requested name -> its shared state (this process)
_OPEN_LOCK = threading.Lock()


class DurableSpool:
    """A handle on one spool (see the module docstring). ``name`` is the file stem asked for;
    ``self.name`` is the one in use (another, if a live process holds that one)."""

    def __init__(self, directory: Path | str, name: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not _NAME.match(name) or name in (".", ".."):
            raise ValueError(f"spool name must match {_NAME.pattern}, got {name!r}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        directory = private_dir(directory)
        key = str((directory / f"{name}{SUFFIX}").resolve())
        with _OPEN_LOCK:
            core = _OPEN.get(key)
            if core is None or core.closed:
                core = _Core(directory, name, max_bytes)
                _OPEN[key] = core
            core.refs += 1
        self._core = core
        self._key = key
        self._closed = False
        self.directory = directory

    @classmethod
    async def open(cls, directory: Path | str, name: str, **kw: Any) -> DurableSpool:
        """Open and recover in a worker thread: the event loop never reads the file."""
        spool = await asyncio.to_thread(cls, directory, name, **kw)
        await asyncio.to_thread(spool.recover)
        return spool

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def path(self) -> Path:
        return self._core.own.path

    @property
    def offset_path(self) -> Path:
        return self._core.own.offset_path

    @property
    def recovered(self) -> bool:
        return self._core.own.recovered

    @property
    def max_bytes(self) -> int:
        return self._core.max_bytes

    def recover(self) -> None:
        """Count what the own file holds (blocking; idempotent). Appends and drains call it too."""
        self._core.recover()

    def adopt_orphans(self, family: str | None = None) -> int:
        """Take over unheld spools of ``family`` (default: this name without its ``@`` suffix).
        Blocking: run it in a thread. Returns the records adopted."""
        return self._core.adopt_orphans(family)

    def append(self, record: dict[str, Any]) -> None:
        """Durably append one record. Blocking (fsync); safe to call from any thread.
        Raises `Unencodable` or `SpoolFull`, having written nothing."""
        self.append_many([record])

    def append_many(self, records: list[dict[str, Any]]) -> None:
        """Durably append ``records`` with one fsync (group commit). Blocking; all or nothing."""
        lines = [encode_record(r) for r in records]
        with self._core.lock:
            self._core._check_room(sum(map(len, lines)))
        self._core.write(lines)

    def submit(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Queue ``record`` for the next group commit (call on the event loop); the future
        resolves once it is fsync'd. Raises `Unencodable` / `SpoolFull` at once, queueing nothing."""
        return self._core.submit(record)

    async def commit(self, record: dict[str, Any]) -> None:
        """Append durably, sharing an fsync with concurrent commits; returns once on disk."""
        await self.submit(record)

    def pending(self) -> int:
        """Records appended (or adopted) but not yet delivered to a sink that returned.

        Reads without the lock: an event loop may call this while a thread holds the lock
        through an fsync, and reading ints is atomic.
        """
        return self._core.pending()

    async def drain(self, batch: int, sink: Callable[[list[dict[str, Any]]], Awaitable[Any]]) -> int:
        """Deliver pending records in order, ``batch`` at a time (adopted files first); return how
        many were delivered.

        If ``sink`` raises, the exception propagates; batches delivered before it stay committed
        and the failed batch is sent again by the next drain.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch!r}")
        core = self._core
        delivered = 0
        async with core.drain_lock:
            while True:
                seg = core.next_segment()
                records, next_offset, count = await asyncio.to_thread(core.read, seg, batch)
                if count == 0:
                    await asyncio.to_thread(core.finish_segment, seg)
                    if seg is core.own:
                        break
                    continue
                if records:
                    await sink(records)
                await asyncio.to_thread(core.advance, seg, next_offset, count)
                delivered += len(records)
        return delivered

    def stats(self) -> dict[str, Any]:
        core = self._core
        with core.lock:
            return {
                **core.counts,
                "name": core.name,
                "pending": core.pending(),
                "committed_offset": core.own.offset,
                "bytes": core.own.size,
                "queued_bytes": core.queued_bytes,
                "max_bytes": core.max_bytes,
                "adopted_pending": sum(s.pending for s in core.adopted),
                "name_collisions": core.collisions,
            }

    def close(self) -> None:
        """Release this handle; the last one releases the lock (the file stays, for an adopter)."""
        if self._closed:
            return
        self._closed = True
        with _OPEN_LOCK:
            self._core.refs -= 1
            if self._core.refs > 0:
                return
            if _OPEN.get(self._key) is self._core:
                del _OPEN[self._key]
        self._core.close()


def _last_line_end(fd: int, size: int) -> int:
    """The byte after the file's last newline (0 if none), reading backwards a chunk at a time."""
    pos = size
    while pos > 0:
        start = max(0, pos - _CHUNK)
        chunk = os.pread(fd, pos - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        pos = start
    return 0


def _count_lines(fd: int, start: int, end: int) -> int:
    count, pos = 0, start
    while pos < end:
        chunk = os.pread(fd, min(_CHUNK, end - pos), pos)
        if not chunk:
            break
        count += chunk.count(b"\n")
        pos += len(chunk)
    return count


def _commit_offset(offset_path: Path, offset: int, directory: Path) -> None:
    tmp = offset_path.with_name(offset_path.name + ".tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        f.write(str(offset))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, offset_path)
    fsync_dir(directory)


PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(directory: Path | str) -> Path:
    """``directory``, made 0700: created so (missing parents too), or an existing one chmodded.

    The mode is set with ``chmod`` after ``mkdir``, so the umask cannot widen or narrow it.
    """
    directory = Path(directory).expanduser()
    missing: list[Path] = []
    p = directory
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:  # another replica made it first: it is ours as much
            if not d.is_dir():
                raise
        os.chmod(d, PRIVATE_DIR_MODE)
    if not missing:
        try:
            os.chmod(directory, PRIVATE_DIR_MODE)
        except PermissionError:
            # Not ours (a configured shared folder): the files in it are still 0600.
            log.warning("cannot make %s private (mode 0700): not its owner", directory)
    return directory


def open_private(path: Path | str, flags: int) -> int:
    """``os.open`` of a file that is 0600 from its creation on (and an older one made 0600).

    ``O_CREAT`` is added; the caller wraps the descriptor (``os.fdopen``) or closes it.
    """
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # umask-independent, and a file created before
    except BaseException:
        os.close(fd)
        raise
    return fd


def json_line(record: Any) -> bytes:
    """One JSON line, UTF-8. Text that UTF-8 cannot hold (a lone surrogate) is written as its JSON
    escape rather than failing: the error would carry the record's text into a log. A value JSON
    cannot hold raises TypeError (see `sanitize` to escape those first)."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    return text.encode("utf-8", "backslashreplace")


def encode_record(record: Any) -> bytes:
    """`json_line` for the spool: strict JSON (no NaN), and every failure an `Unencodable` whose
    reason names the kind of value, never its content."""
    try:
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except TypeError as err:
        raise Unencodable(f"not_json:{_type_in(err)}") from None
    except ValueError as err:
        raise Unencodable("circular" if "ircular" in str(err) else "not_json:non_finite_float") from None
    except RecursionError:
        raise Unencodable("too_deep") from None
    return (text + "\n").encode("utf-8", "backslashreplace")


def _type_in(err: TypeError) -> str:
    m = re.search(r"type (\w+) is not JSON serializable", str(err))
    return m.group(1) if m else "unknown"


MAX_DEPTH = 32


def sanitize(value: Any, depth: int = 0) -> tuple[Any, int]:
    """A JSON-safe copy of ``value`` and how many values were escaped.

    Never raises: a non-finite float becomes its text (``"nan"``), a value JSON cannot hold
    ``{"$unencodable": "<type>"}``, a key that is not a string its ``str``, and anything nested
    deeper than `MAX_DEPTH` ``{"$unencodable": "too_deep"}``. Lone surrogates stay: `json_line`
    writes them as JSON escapes.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value, 0
    if isinstance(value, float):
        return (value, 0) if math.isfinite(value) else (repr(value), 1)
    if depth >= MAX_DEPTH:
        return {"$unencodable": "too_deep"}, 1
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        escaped = 0
        for k, v in value.items():
            if not isinstance(k, str):
                escaped += 1
                k = str(k) if isinstance(k, (int, float, bool)) or k is None else f"$key:{type(k).__name__}"
            out[k], n = sanitize(v, depth + 1)
            escaped += n
        return out, escaped
    if isinstance(value, (list, tuple)):
        items = []
        escaped = 0
        for v in value:
            item, n = sanitize(v, depth + 1)
            items.append(item)
            escaped += n
        return items, escaped
    return {"$unencodable": type(value).__name__}, 1


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (skipped where directories cannot be fsynced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
