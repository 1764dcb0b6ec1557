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
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment
from deployments.enrichments.feature import Feature, Worker
from deployments.enrichments.spool import PRIVATE_FILE_MODE, fsync_dir, json_line, open_private, private_dir

DEFAULT_FILENAME = "audit.log"


class AuditLog(Enrichment):
    features = ("audit_log",)

    def __init__(
        self,
        directory: Path,
        *,
        max_bytes: int = 8 * 1024 * 1024,
        backups: int = 5,
        filename: str = DEFAULT_FILENAME,
    ) -> None:
        super().__init__()
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups!r}")
        self.directory = private_dir(directory)
        self.path = self.directory / filename
        for p in [self.path, *self.directory.glob(f"{filename}.*")]:
            if p.is_file() and not p.is_symlink():
                os.chmod(p, PRIVATE_FILE_MODE)  # written before files were private
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = asyncio.Lock()
        self._file: IO[bytes] | None = None
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._records_written = 0
        self._bytes_written = 0
        self._rotations = 0

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        records = payload.get("records") or []
        # Serialise first: a record that is not JSON-able fails the call before anything is written.
        lines = [json_line(r) for r in records]
        if lines:
            async with self._lock:
                await asyncio.to_thread(self._write, lines)
        return {"ok": True, "written": len(lines)}

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
        }

    async def close(self) -> None:
        async with self._lock:
            if self._file is not None:
                f, self._file = self._file, None
                await asyncio.to_thread(f.close)


class AuditLogSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: Path = Field(description="where audit.log and its rotated files live")
    max_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    backups: int = Field(default=5, ge=0)
    filename: str = Field(default=DEFAULT_FILENAME, min_length=1)


# fsync'd files: its own deployment, one writer.
WORKER = Worker("audit_log", AuditLog, host="AuditLog", settings=AuditLogSettings, state_paths={"directory": "audit"})
AUDIT_LOG = Feature("audit_log", WORKER)


def read_all(directory: Path, filename: str = DEFAULT_FILENAME) -> list[dict[str, Any]]:
    """Every record still on disk, oldest first: ``audit.log.N`` ... ``audit.log.1``, ``audit.log``.

    A final line without its newline (a write torn by a crash) is skipped.
    """
    directory = Path(directory)
    backups = []
    for p in directory.glob(f"{filename}.*"):
        suffix = p.name[len(filename) + 1 :]
        if suffix.isdigit():
            backups.append((int(suffix), p))
    paths = [p for _, p in sorted(backups, reverse=True)]
    if (directory / filename).exists():
        paths.append(directory / filename)
    out: list[dict[str, Any]] = []
    for p in paths:
        for line in p.read_bytes().splitlines(keepends=True):
            if line.endswith(b"\n") and line.strip():
                out.append(json.loads(line))
    return out

