"""Loading user classes named `module:Class` (drafter plugins on both services)."""

from __future__ import annotations

import os
import pkgutil
import sys

from specwire.common.errors import UserError


def load_class(spec: str) -> type:
    """Import `module:Class` (`pkgutil.resolve_name`), with one-line errors naming what went
    wrong. Like `python -m`, plugins may live in the directory the service is started from."""
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise UserError(f"drafter {spec!r} is not of the form module:Class")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj = pkgutil.resolve_name(spec)
    except ValueError as exc:
        raise UserError(f"drafter {spec!r} is not of the form module:Class") from exc
    except ImportError as exc:
        raise UserError(f"cannot import drafter module {module_name!r}: {exc}") from exc
    except AttributeError as exc:
        raise UserError(f"drafter module {module_name!r} has no {attr!r}") from exc
    if not callable(obj):
        raise UserError(f"drafter {spec!r} is not a class")
    return obj
