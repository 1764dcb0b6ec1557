"""Which code a benchmark measured and how it was called, read once when the run starts.

A result file is only worth its figures if they can be traced to the code that produced them.
``code_state`` gives the checkout's commit and the files under the given paths that differed
from it (``git status --porcelain``, results excluded), read before the first request is sent:
a long run outlives edits made beside it, and a figure must never be credited to a commit it
did not run. ``command_line`` records the invocation with the arguments that are paths made
portable: inside the checkout relative to its root, outside it only the file's name behind
``<outside>/``, so a result file carries no path of the machine that wrote it.

Outside a git checkout (an exported tarball) ``commit`` is ``None`` and ``uncommitted`` empty:
unknown, said as such, never guessed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

RESULTS_DIR = "bench/results/"
OUTSIDE = "<outside>/"


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None  # porcelain lines start with a space: no strip


def code_state(root: Path = ROOT, paths: Sequence[str] = ()) -> dict[str, Any]:
    """``{"commit": short hash or None, "uncommitted": [porcelain lines]}`` of ``root``'s checkout.

    ``paths`` narrows the uncommitted files to those under them (default: the whole checkout);
    anything under ``bench/results/`` is left out, since a run writes its own results there."""
    commit = (_git(root, "rev-parse", "--short=7", "HEAD") or "").strip()
    if not commit:
        return {"commit": None, "uncommitted": []}
    status = _git(root, "status", "--porcelain", "--", *paths) or ""
    lines = [line for line in status.splitlines() if line.strip() and RESULTS_DIR not in line]
    return {"commit": commit, "uncommitted": lines}


def portable_arg(arg: str, root: Path = ROOT) -> str:
    """``arg`` unchanged unless it is an absolute path (alone or as ``--flag=/path``): then relative
    to ``root`` where it lies inside it, else ``<outside>/`` and its last component."""
    flag, sep, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    path = Path(os.path.normpath(value))
    try:
        portable = path.relative_to(root).as_posix() or "."
    except ValueError:
        portable = OUTSIDE + path.name
    return f"{flag}{sep}{portable}"


def command_line(script: str, argv: Sequence[str], root: Path = ROOT) -> str:
    """The invocation as a reader would retype it from the checkout's root."""
    return " ".join([script, *(portable_arg(a, root) for a in argv)])


def run_meta(script: str, argv: Sequence[str], code: dict[str, Any], started: float, machine: dict[str, Any],
             **extra: Any) -> dict[str, Any]:
    """A result file's ``meta``: the command (`command_line`), the code measured (`code_state`,
    read at the run's start), the date, the machine, ``extra`` (the run's own settings) and the
    wall time since ``started`` (a `time.monotonic` reading)."""
    return {"command": command_line(script, argv), "code_commit": code["commit"], "uncommitted": code["uncommitted"],
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine, **extra,
            "wall_s": round(time.monotonic() - started, 1)}


def write_result(path: Path, doc: dict[str, Any]) -> None:
    """A result file: ``doc`` as indented JSON, its folder made where missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")

