"""Loading user classes named `module:Class` (drafter plugins on both services)."""

from __future__ import annotations

import importlib
import os
import sys

from common.errors import UserError


def load_class(spec: str) -> type:
    """Import `module:Class`, with one-line errors naming what went wrong.

    Like `python -m`, plugins may live in the directory the service is started from."""
    module_name, _, cls_name = spec.partition(":")
    if not module_name or not cls_name.isidentifier():
        raise UserError(f"drafter {spec!r} is not of the form module:Class")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import drafter module {module_name!r}: {exc}") from exc
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise UserError(f"drafter module {module_name!r} has no {cls_name!r}")
    return cls
