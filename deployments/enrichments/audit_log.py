"""AuditLog: an fsync'd JSON-lines log of finished requests, rotated by size.

One call writes a batch of records, in order, one JSON line each, then flushes and fsyncs once
(group commit: the fsync, not the write, is what costs, so a batch pays it once). Rotation works
like `logging.handlers.RotatingFileHandler`: when the next line would take ``audit.log`` past
``max_bytes`` it becomes ``audit.log.1``, ``.1`` becomes ``.2`` and so on, and ``.{backups}``
is deleted. A line is never split across files; a single line larger than ``max_bytes`` gets a
file of its own. Retention is therefore about ``max_bytes * (backups + 1)`` bytes; older records
are deleted by design.

Records hold prompts and answers: the folder is 0700 and every file 0600 from its creation on,
whatever the umask (files from before that are made 0600 at start).

File work runs in a worker thread under an `asyncio.Lock`, so concurrent calls never interleave
their lines and the event loop never waits on an fsync.

Exactly once. Every record carries a ``record_id`` (the request's id and the feature, set by the
pipeline). A stage time-out does not cancel the remote call, so the ingress may spool or re-send
a batch this log already wrote; a record whose id was written before is skipped and counted
(``duplicates``), within the batch too. The ids still on disk are loaded on open (all files kept
by retention, so the memory is bounded by it, and by ``dedupe_ids`` at most); a record without a
``record_id`` (written before ids existed) is never deduplicated.

Torn tail. A kill during a write can leave ``audit.log`` ending in a partial line (never
acknowledged: the fsync had not returned). On open that tail is moved to ``audit.log.torn``
(appended, fsync'd: kept for an operator, never read back as a record) and cut from the log, and
counted (``torn_tails_repaired``), so the next write starts on a line of its own. `read_all`
skips a partial last line and any line that is not JSON (``skipped`` counts them); it never
fails on a damaged file.

Open (recovery: the torn-tail repair and the id scan) runs in a worker thread, once, from
`warmup` (the host awaits it before the replica is ready) or the first call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment, offload
from deployments.enrichments.feature import Feature, Worker
from deployments.enrichments.spool import PRIVATE_FILE_MODE, fsync_dir, json_line, open_private, private_dir

DEFAULT_FILENAME = "audit.log"
TORN_SUFFIX = ".torn"

log = logging.getLogger(__name__)


class AuditLog(Enrichment):
    features = ("audit_log",)

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = 8 * 1024 * 1024,
        backups: int = 5,
        filename: str = DEFAULT_FILENAME,
        dedupe_ids: int = 1_000_000,
    ) -> None:
        super().__init__()
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups!r}")
        if dedupe_ids < 1:
            raise ValueError(f"dedupe_ids must be >= 1, got {dedupe_ids!r}")
        self.directory = private_dir(directory)
        self.path = self.directory / filename
        for p in [self.path, *self.directory.glob(f"{filename}.*")]:
            if p.is_file() and not p.is_symlink():
                os.chmod(p, PRIVATE_FILE_MODE)  # written before files were private
        self.max_bytes = max_bytes
        self.backups = backups
        self.dedupe_ids = dedupe_ids
        self._lock = asyncio.Lock()
        self._file: IO[bytes] | None = None
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._opened = False
        self._seen: dict[str, None] = {}  # record ids on disk, oldest first (an ordered set)
        self._records_written = 0
        self._bytes_written = 0
        self._rotations = 0
        self._duplicates = 0
        self._torn_repaired = 0
        self._torn_bytes = 0

    async def warmup(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._recover)

    def _recover(self) -> None:
        """Once: move a torn tail aside, then load the ids still on disk (see the module doc)."""
        if self._opened:
            return
        if self.path.exists():
            with open(self.path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                end = _last_line_end(f, size)
                if end < size:
                    f.seek(end)
                    tail = f.read()
                    torn = self.path.with_name(self.path.name + TORN_SUFFIX)
                    with os.fdopen(open_private(torn, os.O_WRONLY | os.O_APPEND), "ab") as t:
                        t.write(tail + b"\n")
                        t.flush()
                        os.fsync(t.fileno())
                    f.truncate(end)
                    f.flush()
                    os.fsync(f.fileno())
                    self._torn_repaired += 1
                    self._torn_bytes += len(tail)
                    log.warning("audit log: moved a torn final line of %d bytes to %s", len(tail), torn.name)
            self._size = end
        for record in _records(self.directory, self.path.name, None):
            rid = record.get("record_id") if isinstance(record, dict) else None
            if isinstance(rid, str):
                self._remember(rid)
        self._opened = True

    def _remember(self, rid: str) -> None:
        self._seen[rid] = None
        if len(self._seen) > self.dedupe_ids:
            del self._seen[next(iter(self._seen))]

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        records = payload.get("records") or []
        # Serialise first: a record that is not JSON-able fails the call before anything is written.
        lines = [(r.get("record_id") if isinstance(r, dict) else None, json_line(r)) for r in records]
        async with self._lock:
            if not self._opened:
                await asyncio.to_thread(self._recover)
            fresh: list[tuple[str | None, bytes]] = []
            batch_ids: set[str] = set()
            for rid, line in lines:
                if isinstance(rid, str) and (rid in self._seen or rid in batch_ids):
                    self._duplicates += 1
                    continue
                if isinstance(rid, str):
                    batch_ids.add(rid)
                fresh.append((rid, line))
            if fresh:
                await offload(self._write, [line for _, line in fresh])
                for rid, _ in fresh:  # after the fsync: a failed write is retried, not skipped
                    if isinstance(rid, str):
                        self._remember(rid)
        return {"ok": True, "written": len(fresh), "duplicates": len(lines) - len(fresh)}

    def _write(self, lines: list[bytes]) -> None:
        f = self._open()
        for line in lines:
            if self._size and self._size + len(line) > self.max_bytes:
                f = self._rotate(f)
            f.write(line)
            self._size += len(line)
            self._bytes_written += len(line)
            self._records_written += 1
        f.flush()
        os.fsync(f.fileno())

    def _open(self) -> IO[bytes]:
        if self._file is None:
            self._file = os.fdopen(open_private(self.path, os.O_WRONLY | os.O_APPEND), "ab")
            self._size = self._file.tell()
        return self._file

    def _rotate(self, f: IO[bytes]) -> IO[bytes]:
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        if self.backups == 0:
            self.path.unlink()
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        fsync_dir(self.directory)
        self._rotations += 1
        return self._open()

    def stats(self) -> dict[str, Any]:
        return {
            "records_written": self._records_written,
            "bytes": self._bytes_written,
            "rotations": self._rotations,
            "current_file_bytes": self._size,
            "duplicates": self._duplicates,
            "torn_tails_repaired": self._torn_repaired,
            "torn_bytes": self._torn_bytes,
            "ids_remembered": len(self._seen),
        }

    async def close(self) -> None:
        async with self._lock:
            if self._file is not None:
                f, self._file = self._file, None
                await asyncio.to_thread(f.close)


def _last_line_end(f: IO[bytes], size: int, chunk: int = 1 << 20) -> int:
    """The byte after the last newline of ``f`` (0 if none), reading backwards."""
    pos = size
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        nl = f.read(pos - start).rfind(b"\n")
        if nl >= 0:
            return start + nl + 1
        pos = start
    return 0


class AuditLogSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: Path = Field(description="where audit.log and its rotated files live")
    max_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    backups: int = Field(default=5, ge=0)
    filename: str = Field(default=DEFAULT_FILENAME, min_length=1)
    dedupe_ids: int = Field(default=1_000_000, ge=1, description="record ids remembered for dedupe, at most")


# fsync'd files: its own deployment, one writer.
WORKER = Worker("audit_log", AuditLog, host="AuditLog", settings=AuditLogSettings, state_paths={"directory": "audit"})
# Every request that reached the model is audited, failed, dropped and refused ones too.
AUDIT_LOG = Feature("audit_log", WORKER, audits_failures=True)


def log_files(directory: Path, filename: str = DEFAULT_FILENAME) -> list[Path]:
    """The log's files, oldest first: ``audit.log.N`` ... ``audit.log.1``, ``audit.log``."""
    directory = Path(directory)
    backups = []
    for p in directory.glob(f"{filename}.*"):
        suffix = p.name[len(filename) + 1 :]
        if suffix.isdigit():
            backups.append((int(suffix), p))
    paths = [p for _, p in sorted(backups, reverse=True)]
    if (directory / filename).exists():
        paths.append(directory / filename)
    return paths


def _records(directory: Path, filename: str, skipped: list[str] | None) -> Iterator[Any]:
    for p in log_files(directory, filename):
        try:
            f = open(p, "rb")
        except FileNotFoundError:  # rotated away meanwhile
            continue
        with f:
            for n, line in enumerate(f, 1):
                if not line.endswith(b"\n"):
                    if skipped is not None:
                        skipped.append(f"{p.name}:{n}: partial last line")
                    continue
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except ValueError:
                    if skipped is not None:
                        skipped.append(f"{p.name}:{n}: not JSON")


def read_all(directory: Path, filename: str = DEFAULT_FILENAME, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every record still on disk, oldest first: ``audit.log.N`` ... ``audit.log.1``, ``audit.log``.

    Never fails on a damaged file: a final line without its newline (a write torn by a crash) and
    a line that is not JSON are skipped, each noted in ``skipped`` (file, line, why) if given.
    """
    return list(_records(Path(directory), filename, skipped))
