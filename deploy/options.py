"""How an option is declared once and read from every place a user can set it.

A configuration is a dataclass whose fields carry their help text, bounds and flag spelling as metadata
(`option(...)`). From that one declaration come the command-line flags (`add_flags`), the conversion of the text
that `serve run key=value`, YAML files and flags deliver (`coerce`), the range checks (`check_bounds`) and the
reference page docs/configuration.md (deploy/config_docs.py). Adding an option is adding one field.

The engine's options are declared by the engine's config dataclasses (engine.config.engine_options): a serving
option of the same name takes its type and default from there (`engine_option`), and adds only what serving says
about it (help, bounds, flag spellings); `options_class` makes the dataclass of such rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, Field
from typing import Any

import yaml

_NONE = {"none", "null", "~", ""}
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING,  # noqa: A002 - argparse's word
           flags: tuple[str, ...] = (), minimum: float | None = None, maximum: float | None = None,
           choices: tuple[Any, ...] | None = None, metavar: str | None = None, on_cpu: str | None = None,
           engine: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A declared field.

    help: one sentence or two, without the default (the docs and `--help` add it).
    flags: extra spellings of its flag besides `--field-name` (vLLM's `-tp`, say).
    minimum / maximum / choices: checked by `check_bounds` (None values are "unset" and pass).
    on_cpu: what the option does when the engine runs on CPU, said at start-up when it is set there.
    engine: how the engine builders take it: "llm" (engine.LLM's own keyword argument, always passed) or "extra"
    (an EngineConfig field, passed through their **engine_kwargs only when set to other than its default, so that
    a builder of one's own need not know it); None: a serving option.
    aliases: older names still accepted in YAML files and `serve run` arguments (with a deprecation warning).
    """
    meta = {"help": help, "flags": flags, "minimum": minimum, "maximum": maximum, "choices": choices,
            "metavar": metavar, "on_cpu": on_cpu, "engine": engine, "aliases": aliases}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def engine_option(name: str, *, hint: Any = None, serving_default: Any = MISSING,
                  **meta: Any) -> tuple[str, Any, Field]:
    """A row of `options_class`: the engine option `name`, with the type and default of the engine's field that
    declares it (engine.config.engine_options) and `meta` as `option` takes it.

    hint: a wider type where serving also takes another form of the value (text a flag gives), else the field's.
    serving_default: only where serving means something other than the engine by unset (say what in `help`).
    """
    from engine.config import engine_options, option_default

    cls, _ = engine_options()[name]
    if hint is None:
        hint = typing.get_type_hints(cls)[name]
    overridden = serving_default is not MISSING
    f = option(serving_default if overridden else option_default(name), **meta)
    f.metadata = types.MappingProxyType({**f.metadata, "declared_by": cls.__name__, "serving_default": overridden})
    return name, hint, f


def serving_option(name: str, hint: Any, declared: Field) -> tuple[str, Any, Field]:
    """A row of `options_class` for an option of serving's own (no engine field of that name)."""
    return name, hint, declared


def options_class(name: str, doc: str, module: str, rows: list[tuple[str, Any, Field]]) -> type:
    """The dataclass of `rows` (`engine_option` / `serving_option`), in their order."""
    return dataclasses.make_dataclass(name, rows, namespace={"__doc__": doc, "__module__": module})


def fields_of(cls: type) -> list[Field]:
    return list(dataclasses.fields(cls))


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default  # type: ignore[misc]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def aliases_of(cls: type) -> dict[str, str]:
    """Older names -> the field's name."""
    return {a: f.name for f in fields_of(cls) for a in f.metadata.get("aliases", ())}


# --- conversion --------------------------------------------------------------------------------------------
def coerce(cls: type, values: dict[str, Any], warn: Any = None) -> dict[str, Any]:
    """Normalise keys (`num-replicas` -> `num_replicas`, older names -> current), reject unknown ones, convert
    strings to the fields' types."""
    hints = typing.get_type_hints(cls)
    old = aliases_of(cls)
    out = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in old:
            if warn is not None:
                warn(f"config field {key!r} is deprecated: it is now {old[name]!r}")
            name = old[name]
        if name not in hints:
            known = ", ".join(f.name for f in fields_of(cls))
            raise ValueError(f"unknown config field {key!r}; known fields: {known}")
        out[name] = convert(name, value, hints[name])
    return out


def convert(name: str, value: Any, hint: Any) -> Any:
    """`value` (text from a flag or `serve run`, or YAML's own type) as the field's type; ValueError naming it."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args and typing.get_origin(hint) is not dict \
        else hint
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in _NONE):
        if not optional:
            raise ValueError(f"config field {name} cannot be empty")
        return None
    origin = typing.get_origin(base) or base
    try:
        if origin is dict:
            if isinstance(value, str):
                value = yaml.safe_load(value)  # `serve run ... autoscaling_config='{min_replicas: 1}'`
            if not isinstance(value, dict):
                raise ValueError("expected a mapping")
            return value
        if origin is bool:
            if isinstance(value, str):
                v = value.strip().lower()
                if v not in _TRUE | _FALSE:
                    raise ValueError("expected true or false")
                return v in _TRUE
            if not isinstance(value, (bool, int)):
                raise ValueError("expected true or false")
            return bool(value)
        if origin is int and str in args and isinstance(value, str) and not value.strip().lstrip("-").isdigit():
            return value.strip()  # `int | str` fields: a word ("auto") stays one; validate() judges it
        if origin is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if origin is float:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if origin is str:
            return str(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"config field {name}: cannot use {value!r} ({e})") from e
    return value


def check_bounds(cfg: Any) -> None:
    """Raise ValueError naming the first field outside its declared range or choices."""
    for f in fields_of(type(cfg)):
        value = getattr(cfg, f.name)
        if value is None:
            continue
        lo, hi, choices = f.metadata.get("minimum"), f.metadata.get("maximum"), f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be one of {list(choices)}, got {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if lo is not None and value < lo:
                raise ValueError(f"{f.name} must be >= {lo:g}, got {value!r}")
            if hi is not None and value > hi:
                raise ValueError(f"{f.name} must be <= {hi:g}, got {value!r}")


# --- flags ------------------------------------------------------------------------------------------------
def describe_default(f: Field) -> str:
    d = default_of(f)
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return "on" if d else "off"
    if isinstance(d, dict):
        return "{}" if not d else str(d)
    return str(d)


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, *, suppress: bool = True,
              skip: tuple[str, ...] = (), title: str | None = None) -> None:
    """A flag for every field of `cls`. suppress: a flag not given is absent from the namespace (a --config file's
    value then holds); else it carries the field's default."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title) if title else parser
    for f in fields_of(cls):
        if f.name in skip:
            continue
        m = f.metadata
        names = [flag_name(f.name), *m.get("flags", ())]
        default = argparse.SUPPRESS if suppress else default_of(f)
        help_text = f"{m['help']} (default: {describe_default(f)})".replace("%", "%%")
        hint = hints[f.name]
        base_types = set(typing.get_args(hint)) or {hint}
        if base_types <= {bool, type(None)}:
            group.add_argument(*names, dest=f.name, default=default, help=help_text,
                               action=argparse.BooleanOptionalAction)
            continue
        choices = m.get("choices")
        group.add_argument(*names, dest=f.name, default=default, help=help_text, type=_flag_type(f.name, hint),
                           choices=choices, metavar=m.get("metavar"))


def _flag_type(name: str, hint: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            return convert(name, text, hint)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    parse.__name__ = name
    return parse
