"""Personalization: a per-user system-prompt prefix and sampling temperature from SQLite.

Profiles live in ``profiles(user_id PRIMARY KEY, display_name, tone, language, temperature,
system_prefix)``. With ``seed_demo`` an empty table is filled with ``demo_users`` deterministic
users ``user-0000``, ``user-0001``, ... (fixed seed, ``INSERT OR IGNORE``), so seeding twice, or
from two replicas sharing the file at once, leaves exactly one row per user.

The database (and SQLite's ``-journal``, ``-wal`` and ``-shm`` files, which SQLite creates with
the database's own mode) is 0600 in a 0700 folder: it maps user ids to profiles.

A lookup is one primary-key query in a worker thread; a single connection is shared by the
worker threads under a lock (SQLite connections are not safe for concurrent use).
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deployments.enrichments.base import Enrichment, offload
from deployments.enrichments.feature import Feature, RequestState, Worker
from deployments.enrichments.spool import PRIVATE_FILE_MODE, open_private, private_dir

_SIDE_FILES = ("-journal", "-wal", "-shm")

DEMO_SEED = 20240601
TONES = ("formal", "friendly", "terse", "playful", "patient", "technical")
# Mostly English, as real traffic would be; the others exercise the language line of the prefix.
LANGUAGES = ("English", "English", "English", "English", "French", "German", "Spanish")
FIRST_NAMES = ("Ada", "Alan", "Grace", "Linus", "Margaret", "Dennis", "Barbara", "Ken", "Frances", "Edsger")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS profiles (
    user_id TEXT PRIMARY KEY,
    display_name TEXT NOT NULL,
    tone TEXT NOT NULL,
    language TEXT NOT NULL,
    temperature REAL NOT NULL,
    system_prefix TEXT NOT NULL
)
"""


def demo_profiles(n: int, seed: int = DEMO_SEED) -> list[tuple[str, str, str, str, float, str]]:
    """``n`` deterministic profile rows: the same ``seed`` always gives the same rows."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        name = f"{rng.choice(FIRST_NAMES)} {i:04d}"
        tone = rng.choice(TONES)
        language = rng.choice(LANGUAGES)
        temperature = round(rng.uniform(0.2, 1.0), 2)
        prefix = f"The user is {name}. Answer in a {tone} tone."
        if language != "English":
            prefix += f" Reply in {language}."
        rows.append((f"user-{i:04d}", name, tone, language, temperature, prefix))
    return rows


class Personalization(Enrichment):
    features = ("personalization",)

    def __init__(self, db_path: Path, *, seed_demo: bool = True, demo_users: int = 1000) -> None:
        super().__init__()
        self.db_path = private_dir(Path(db_path).expanduser().parent) / Path(db_path).name
        os.close(open_private(self.db_path, os.O_RDWR))  # exists, 0600, before SQLite opens it
        for suffix in _SIDE_FILES:  # left by an older run, before files were private
            side = self.db_path.with_name(self.db_path.name + suffix)
            if side.is_file() and not side.is_symlink():
                os.chmod(side, PRIVATE_FILE_MODE)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, timeout=30.0)
        with self._lock, self._db:
            self._db.execute(_SCHEMA)
            empty = self._db.execute("SELECT NOT EXISTS (SELECT 1 FROM profiles)").fetchone()[0]
            if seed_demo and empty:
                self._db.executemany(
                    "INSERT OR IGNORE INTO profiles VALUES (?, ?, ?, ?, ?, ?)", demo_profiles(demo_users)
                )
        self._lookups = 0
        self._hits = 0

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        user = payload.get("user")
        if not isinstance(user, str) or not user:
            return {}
        self._lookups += 1
        try:
            user.encode()
        except UnicodeEncodeError:
            return {}  # no profile has it; and SQLite's error would carry the id into a log
        row = await offload(self._fetch, user)
        if row is None:
            return {}
        self._hits += 1
        prefix, temperature = row
        return {"system_prefix": prefix, "sampling": {"temperature": temperature}}

    def _fetch(self, user: str) -> tuple[str, float] | None:
        with self._lock:
            return self._db.execute(
                "SELECT system_prefix, temperature FROM profiles WHERE user_id = ?", (user,)
            ).fetchone()

    def stats(self) -> dict[str, Any]:
        return {"lookups": self._lookups, "hits": self._hits}

    async def close(self) -> None:
        def _close() -> None:
            with self._lock:
                self._db.close()

        await asyncio.to_thread(_close)


class PersonalizationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    db_path: Path = Field(description="the SQLite profile database")
    seed_demo: bool = Field(default=True, description="fill an empty table with demo users")
    demo_users: int = Field(default=1000, ge=0)


def _apply(request: RequestState, result: Mapping[str, Any]) -> None:
    if result.get("system_prefix") or result.get("sampling"):
        request.personal = True  # a profile shaped the prompt: the answer is this user's own
    request.add_system(result.get("system_prefix", ""), prepend=True)
    request.fill_sampling(result.get("sampling"))


# SQLite: state on disk and blocking I/O, so its own deployment.
WORKER = Worker("personalization", Personalization, host="Personalization",
                settings=PersonalizationSettings, state_paths={"db_path": "profiles.sqlite"})
PERSONALIZATION = Feature("personalization", WORKER, apply=_apply)
