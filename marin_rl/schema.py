"""The shape of a config: raw YAML checked against the config dataclasses, and the list of keys.

`normalize` walks the raw mapping along the dataclass fields before draccus decodes it, so every
mistake is reported from structure (a key path, the value, what the field allows), never by
parsing draccus's messages; `config_keys` lists every key with its default for `train --help`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from typing import Any, Iterator

import draccus
from draccus.wrappers.docstring import get_attribute_docstring

TYPE_KEY = draccus.CHOICE_TYPE_KEY
"""The key that picks a registered variant (`algorithm: {type: grpo}`)."""


class SchemaError(ValueError):
    """A raw config value does not fit its field; `path` is the key path, e.g. ('envs', '0', 'group_size')."""

    def __init__(self, path: tuple[str, ...], message: str):
        super().__init__(f"{'.'.join(path) or 'config'}: {message}")
        self.path = path


def normalize(cls: type, raw: Any, path: tuple[str, ...] = ()) -> dict:
    """`raw` checked against dataclass `cls`, with lenient scalars made exact (`"1e-5"` -> 1e-5 for a
    float, 2024 -> "2024" for a string). Raises `SchemaError` at the first mistake."""
    return _section(cls, raw, path)


def _section(cls: type, raw: Any, path: tuple[str, ...]) -> dict:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SchemaError(path, f"{raw!r} is not a section (a mapping of keys to values)")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    out = {}
    for key, value in raw.items():
        if key not in fields:
            raise SchemaError(path + (str(key),), _unknown(str(key), list(fields)))
        out[key] = _value(hints[key], value, path + (key,))
    missing = [n for n, f in fields.items() if n not in raw and _is_required(f)]
    if missing:
        raise SchemaError(path + (missing[0],), f"is required ({cls.__name__} needs {missing})")
    return out


def _choice(cls: type, raw: dict, path: tuple[str, ...]) -> dict:
    choices = cls.get_known_choices()
    name = raw.get(TYPE_KEY, _default_choice(cls))
    if name not in choices:
        message = f"{name!r} is not one of {sorted(choices)}" if TYPE_KEY in raw else f"is required, one of {sorted(choices)}"
        raise SchemaError(path + (TYPE_KEY,), message)
    rest = _section(choices[name], {k: v for k, v in raw.items() if k != TYPE_KEY}, path)
    return {TYPE_KEY: name, **rest}


def _value(tp: Any, value: Any, path: tuple[str, ...]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _value(option, value, path)
            except SchemaError as e:
                if e.path != path:  # a mistake inside a section: that one is the news
                    raise
        raise SchemaError(path, f"{value!r} is not {describe(tp)}")
    if origin is typing.Literal:
        if value not in args:
            raise SchemaError(path, f"{value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise SchemaError(path, f"{value!r} is not {describe(tp)}")
        item = args[0] if args else Any
        return [_value(item, v, path + (str(i),)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError(path, f"{value!r} is not a mapping")
        return {k: _value(args[1] if args else Any, v, path + (str(k),)) for k, v in value.items()}
    if _is_choice(tp):
        if not isinstance(value, dict):
            raise SchemaError(path, f"{value!r} is not a section (a mapping with `{TYPE_KEY}:`)")
        return _choice(tp, value, path)
    if dataclasses.is_dataclass(tp):
        return _section(tp, value, path)
    return _scalar(tp, value, path)


def _scalar(tp: type, value: Any, path: tuple[str, ...]) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `--run_dir 2024`, `name: 1`
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = [m.value for m in tp]
        if value in allowed:
            return value
        raise SchemaError(path, f"{value!r} is not one of {allowed}")
    else:
        return value  # a type this check does not know: draccus decides
    raise SchemaError(path, f"{value!r} is not {describe(tp)}")


def describe(tp: Any) -> str:
    """What a field takes, in words: `a number`, `an integer or null`, ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is typing.Literal:
        return f"one of {list(args)}"
    if origin in (list, tuple):
        return "a list of sections" if args and dataclasses.is_dataclass(args[0]) else "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a section"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _unknown(key: str, allowed: list[str]) -> str:
    # An abbreviation (`lr` for `learning_rate`) first, then the closest spelling.
    close = [a for a in allowed if "".join(w[:1] for w in a.split("_")) == key] or difflib.get_close_matches(key, allowed, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key{hint}; allowed: {allowed}"


def _is_choice(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, draccus.ChoiceRegistry) and hasattr(cls, "get_known_choices")


def _default_choice(cls: type) -> str | None:
    try:
        return cls.default_choice_name()
    except (AttributeError, NotImplementedError):
        return None


def _is_required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# --- the list of keys (train --help) -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    path: str
    """Dotted key, `envs[].group_size` for a field of every list item."""
    default: str
    """The default as YAML would spell it, or `(required)`."""
    doc: str
    """The first sentence of the field's docstring."""


def config_keys(cls: type, prefix: str = "") -> Iterator[Key]:
    """Every leaf key of `cls` with its default; a variant (`type:`) lists its default's fields."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = _strip_optional(hints[f.name])
        key = prefix + f.name
        doc = _first_sentence(get_attribute_docstring(cls, f.name).docstring_below)
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if _is_choice(tp):
            choice = _default_choice(tp) if default is None else tp.get_choice_name(type(default))
            yield Key(f"{key}.{TYPE_KEY}", str(choice), f"{doc} One of {sorted(tp.get_known_choices())}.")
            if choice is not None:
                yield from config_keys(tp.get_known_choices()[choice], f"{key}.")
        elif dataclasses.is_dataclass(tp):
            yield from config_keys(tp, f"{key}.")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            yield from config_keys(typing.get_args(tp)[0], f"{key}[].")
        else:
            shown = "(required)" if _is_required(f) else _yaml_scalar(default)
            yield Key(key, shown, doc)


def _strip_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        value = list(value)
    return str(value)


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]
