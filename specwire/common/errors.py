"""Errors a user can act on. The CLI prints them as one line; servicers map them to
INVALID_ARGUMENT (or the status named by `code`)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from a user: flag, file, model name, request field."""

    code: str = "INVALID_ARGUMENT"
