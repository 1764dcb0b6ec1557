"""DurableSpool: a crash-safe FIFO of JSON records, for the ``defer`` off-mode.

While a deferred feature is off, its work is appended here; once the level allows it again,
`drain` hands the records to the real sink, in the order they were appended.

On disk, for ``name``: ``{name}.spool`` holds one JSON line per record and ``{name}.offset`` the
byte offset up to which records have been delivered (the committed offset). `append` writes a
line, flushes and fsyncs before returning. `drain` reads a batch from the committed offset,
awaits ``sink(batch)`` and only then moves the offset forward, by writing a temporary file,
fsyncing it and renaming it over the old one, so the offset file always holds either the old or
the new value. A new `DurableSpool` on the same directory and name (a restarted replica) starts
from the committed offset and so sees every record not yet delivered.

Delivery is at-least-once: if the sink raises, or the process dies after the sink succeeded but
before the offset was committed, that batch is sent again by the next drain. Sinks that must not
see a record twice should deduplicate on a field of the record (e.g. ``request_id``).

When a drain leaves nothing pending the spool file is truncated and the offset reset to 0, so the
file only grows while a backlog exists.

Records hold prompts and answers, so every file here is private: the folder is 0700 and each file
0600 from the moment it is created, whatever the process's umask (`private_dir`, `open_private`,
which the other enrichments that write files use too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class DurableSpool:
    def __init__(self, directory: Path, name: str) -> None:
        if not _NAME.match(name) or name in (".", ".."):
            raise ValueError(f"spool name must match {_NAME.pattern}, got {name!r}")
        self.directory = private_dir(directory)
        self.name = name
        self.path = self.directory / f"{name}.spool"
        self.offset_path = self.directory / f"{name}.offset"
        self._lock = threading.Lock()  # guards the file, the offset and the counters
        self._drain_lock = asyncio.Lock()  # one drain at a time
        self._file: IO[bytes] | None = None
        self._appended = 0
        self._delivered = 0
        self._corrupt = 0
        self._offset, self._pending = self._recover()

    def _recover(self) -> tuple[int, int]:
        """Read the committed offset, drop a torn final line, count the records still pending."""
        for path in (self.path, self.offset_path):
            if path.exists():
                os.chmod(path, PRIVATE_FILE_MODE)  # written before files were private
        offset = int(self.offset_path.read_text().strip() or 0) if self.offset_path.exists() else 0
        data = self.path.read_bytes() if self.path.exists() else b""
        end = data.rfind(b"\n") + 1
        if end < len(data):
            # The last append died before its fsync returned, so it was never acknowledged.
            log.warning("spool %s: dropping a torn final line of %d bytes", self.path, len(data) - end)
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
            data = data[:end]
        if offset > len(data):
            # A reset truncated the file but died before writing offset 0.
            offset = 0
            self._commit_offset(0)
        return offset, data[offset:].count(b"\n")

    def append(self, record: dict[str, Any]) -> None:
        """Durably append one record. Blocking (fsync); safe to call from any thread."""
        line = json_line(record)
        with self._lock:
            if self._file is None:
                self._file = os.fdopen(open_private(self.path, os.O_WRONLY | os.O_APPEND), "ab")
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._pending += 1
            self._appended += 1

    def pending(self) -> int:
        """Records appended but not yet delivered to a sink that returned.

        Reads without the lock: an event loop may call this while a thread holds the lock
        through an fsync, and reading one int is atomic.
        """
        return self._pending

    async def drain(self, batch: int, sink: Callable[[list[dict[str, Any]]], Awaitable[Any]]) -> int:
        """Deliver pending records in order, ``batch`` at a time; return how many were delivered.

        If ``sink`` raises, the exception propagates; batches delivered before it stay committed
        and the failed batch is sent again by the next drain.
        """
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch!r}")
        delivered = 0
        async with self._drain_lock:
            while True:
                records, next_offset, count = await asyncio.to_thread(self._read, batch)
                if count == 0:
                    break
                if records:
                    await sink(records)
                await asyncio.to_thread(self._advance, next_offset, count)
                delivered += len(records)
            await asyncio.to_thread(self._reset_if_empty)
        return delivered

    def _read(self, batch: int) -> tuple[list[dict[str, Any]], int, int]:
        """Up to ``batch`` records from the committed offset, the offset after them, lines read."""
        with self._lock:
            offset = self._offset
            if not self.path.exists():
                return [], offset, 0
            records: list[dict[str, Any]] = []
            lines = 0
            with open(self.path, "rb") as f:
                f.seek(offset)
                while len(records) < batch:
                    line = f.readline()
                    if not line.endswith(b"\n"):
                        break
                    offset += len(line)
                    lines += 1
                    try:
                        records.append(json.loads(line))
                    except ValueError:
                        # Only disk corruption gets here; skipping it keeps the spool moving.
                        self._corrupt += 1
                        log.error("spool %s: skipping a corrupt record at byte %d", self.path, offset - len(line))
            return records, offset, lines

    def _advance(self, offset: int, lines: int) -> None:
        with self._lock:
            self._commit_offset(offset)
            self._offset = offset
            self._pending -= lines
            self._delivered += lines

    def _reset_if_empty(self) -> None:
        with self._lock:
            if self._pending or self._offset == 0:
                return
            # Truncate first: if we die before the offset is reset, _recover sees offset > size.
            if self._file is not None:
                self._file.close()
                self._file = None
            with open(self.path, "r+b") as f:
                f.truncate(0)
                f.flush()
                os.fsync(f.fileno())
            self._commit_offset(0)
            self._offset = 0

    def _commit_offset(self, offset: int) -> None:
        tmp = self.offset_path.with_name(self.offset_path.name + ".tmp")
        with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
            f.write(str(offset))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.offset_path)
        fsync_dir(self.directory)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "pending": self._pending,
                "appended": self._appended,
                "delivered": self._delivered,
                "corrupt_skipped": self._corrupt,
                "committed_offset": self._offset,
            }

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


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
    escape rather than failing: the error would carry the record's text into a log."""
    text = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    return text.encode("utf-8", "backslashreplace")


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
