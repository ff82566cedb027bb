"""Command-line flags derived from a frozen config dataclass, each with a `SPECWIRE_*`
environment variable (for containers); a flag on the command line wins over the variable,
which wins over the dataclass default.

    FLAGS = {"max_draft_len": Flag("most draft tokens per step"), ...}
    add_config_flags(parser, TargetConfig, FLAGS)
    config = TargetConfig(**config_kwargs(args, FLAGS))

A field `max_draft_len` becomes `--max-draft-len` and `SPECWIRE_MAX_DRAFT_LEN` unless its
`Flag` names others; the type and default come from the dataclass. A bool field that defaults
to True becomes `--no-<name>` / `SPECWIRE_NO_<NAME>` (it turns a default-on feature off); one
that defaults to None (`bool | None`: the config decides, "auto") becomes the pair `--<name>` /
`--no-<name>`, its variable 1/0 (unset, empty or `auto`: auto).
`--help` shows each flag's variable and default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Callable, Mapping
from typing import Any

from specwire.common.errors import UserError

PREFIX = "SPECWIRE_"
_FROM_CONFIG: Any = object()  # "take the dataclass field's default"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line (everything but `help` is optional)."""

    help: str
    flag: str | None = None  # default: --field-name (--no-field-name for default-True bools)
    env: str | None = None  # default: SPECWIRE_ + the flag name in upper snake case
    default: Any = _FROM_CONFIG  # default: the dataclass field's default
    choices: tuple[str, ...] | None = None


def env_value(name: str, default: Any, kind: Callable[[str], Any] = str) -> Any:
    """`kind(os.environ[name])`, or `default` when the variable is unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if kind is bool:
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise UserError(f"environment variable {name}={raw!r} is not a boolean (1/0, true/false)")
    try:
        return kind(raw)
    except ValueError as exc:
        kind_name = getattr(kind, "__name__", "value")
        raise UserError(f"environment variable {name}={raw!r} is not a valid {kind_name}") from exc


def add_env_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    default: Any,
    help: str,  # noqa: A002 - argparse's name
    kind: Callable[[str], Any] = str,
    dest: str | None = None,
    choices: tuple[str, ...] | None = None,
) -> None:
    """One flag backed by environment variable `env`. A `bool` kind is a switch: giving the
    flag sets it to True (the variable takes 1/0, true/false)."""
    shown = f"{help} [env {env}; default %(default)s]"
    value = env_value(env, default, kind)
    if choices and value is not None and value not in choices:  # argparse checks flags only
        raise UserError(f"environment variable {env}={value!r}: expected {' | '.join(choices)}")
    if kind is bool:
        parser.add_argument(flag, action="store_true", default=value, dest=dest, help=shown)
    else:
        metavar = None if choices else flag.lstrip("-").replace("-", "_").upper()
        parser.add_argument(
            flag, type=kind, default=value, dest=dest, help=shown, choices=choices, metavar=metavar
        )


def add_config_flags(
    parser: argparse.ArgumentParser, config_cls: type, flags: Mapping[str, Flag]
) -> None:
    """Add a flag for each field of `config_cls` named in `flags` (dest = the field name)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    types = typing.get_type_hints(config_cls)
    for name, spec in flags.items():
        field = fields[name]  # KeyError here is a typo in the caller's table
        default = field.default if spec.default is _FROM_CONFIG else spec.default
        kind = _scalar(types[name])
        if kind is bool and field.default is True:
            flag = spec.flag or f"--no-{name.replace('_', '-')}"
            env = spec.env or PREFIX + flag[2:].replace("-", "_").upper()
            # A negative switch: the variable/flag says "off"; dest holds the field's value.
            off = env_value(env, False, bool)
            parser.add_argument(
                flag,
                action="store_false",
                dest=name,
                default=not off,
                help=f"{spec.help} [env {env}=1]",
            )
            continue
        flag = spec.flag or f"--{name.replace('_', '-')}"
        env = spec.env or PREFIX + flag[2:].replace("-", "_").upper()
        if kind is bool and field.default is None:
            # Three states: --flag (on), --no-flag (off), neither (None: the config's auto).
            raw = os.environ.get(env, "")
            auto = raw.strip().lower() in ("", "auto")
            parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                dest=name,
                default=None if auto else env_value(env, None, bool),
                help=f"{spec.help} [env {env}=1|0|auto; default auto]",
            )
            continue
        add_env_flag(parser, flag, env, default, spec.help, kind, dest=name, choices=spec.choices)


def config_kwargs(args: argparse.Namespace, flags: Mapping[str, Flag]) -> dict[str, Any]:
    """The parsed values of the fields in `flags`, as keyword arguments for the config."""
    return {name: getattr(args, name) for name in flags}


def _scalar(hint: Any) -> Callable[[str], Any]:
    """`int` for `int`, `str` for `str | None`, ..."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


# The name the security flags and the gateway use.
env_default = env_value
