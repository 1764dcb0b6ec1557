"""API key and admin token for the benchmarks (`serve_app.security`).

A benchmark that deploys its own app makes a private keys file and admin token in its temp
folder: one key with limits far above any benchmark rate (the rate limits are measured by the
security tests, not here), so every request pays the real key check and nothing is throttled.
Against a running app (``--url``), `env_headers` reads ``BROWNOUT_API_KEY`` and
``BROWNOUT_ADMIN_TOKEN``, or the files `make serve` writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOMY = {"requests": "100000/second", "tokens": "100000000/second"}


def local_secrets(folder: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(the ``auth:`` args to deploy with, the headers every request sends)."""
    from serve_app.security import RateSettings, add_key, ensure_admin_token

    folder.mkdir(parents=True, exist_ok=True)
    # tier critical: the key's tier is a ceiling, so the benchmark's criticality header can send
    # each of the three classes (a standard key would serve its "critical" share as standard)
    key, _ = add_key(folder / "keys.yaml", "bench", "critical", "bench", RateSettings(**ROOMY))
    token, _ = ensure_admin_token(folder / "admin_token")
    auth = {"api_keys": "required", "keys_file": str(folder / "keys.yaml"),
            "admin_token_file": str(folder / "admin_token"), "default_rate": ROOMY}
    return auth, headers(key, token)


def headers(key: str | None, token: str | None) -> dict[str, str]:
    out = {}
    if key:
        out["Authorization"] = f"Bearer {key}"
    if token:
        out["X-Brownout-Admin-Token"] = token
    return out


def env_headers() -> dict[str, str]:
    """For a running app: the environment's key and token, else `make serve`'s files."""
    conf = Path.home() / ".config" / "brownout"

    def read(env: str, name: str) -> str | None:
        if os.environ.get(env):
            return os.environ[env]
        path = conf / name
        return path.read_text().strip() if path.exists() else None

    return headers(read("BROWNOUT_API_KEY", "api_key"), read("BROWNOUT_ADMIN_TOKEN", "admin_token"))
