"""Flags that fall back to SPECWIRE_* environment variables (for docker compose); flags win."""

from __future__ import annotations

import os

from common.errors import UserError


def env_default(name: str, default, kind=str):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        return kind(raw)
    except ValueError as exc:
        raise UserError(
            f"environment variable {name}={raw!r} is not a valid {kind.__name__}"
        ) from exc
