"""Message schemas: a message dataclass's fields with their limits, and the checks that build one
from a decoded msgpack map.

A header is a msgpack map whose keys are exactly a message's field names. Unknown keys, missing
required keys, wrong types and values past a field's limits are `invalid_request` errors, never
exceptions that escape a process's receive loop. Each class's checks are compiled once, from its
type hints and field metadata.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any

import msgspec

from .errors import ProtocolError, invalid


def limit(max_len: int | None = None, lo: float | None = None, hi: float | None = None) -> dict:
    return {"max_len": max_len, "lo": lo, "hi": hi}


def wire_field(default: Any = dataclasses.MISSING, **limits: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=list, metadata=limit(**limits))
    return field(default=default, metadata=limit(**limits))


def to_header(msg: Any) -> dict:
    """The msgpack-ready map of a message (nested dataclasses become maps)."""
    nested = _NESTED.get(type(msg))
    if nested is None:
        nested = _NESTED[type(msg)] = _nesting(type(msg))
    return {name: _plain(getattr(msg, name)) if deep else getattr(msg, name)
            for name, deep in nested}


_NESTED: dict[type, list[tuple[str, bool]]] = {}


def _nesting(cls: type) -> list[tuple[str, bool]]:
    """Each field's name and whether it may hold dataclasses (the rest go to msgpack as they
    are): the hot messages are mostly ints and lists of ints."""
    plain = (int, float, str, bool, dict, type(None))

    def deep(tp: Any) -> bool:
        if tp in plain:
            return False
        args = typing.get_args(tp)
        return not args or any(deep(a) for a in args)

    hints = typing.get_type_hints(cls)
    return [(f.name, deep(hints[f.name])) for f in dataclasses.fields(cls)]


def _plain(value: Any) -> Any:
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    if isinstance(value, list):  # lists are of one type: dataclasses, or scalars msgpack takes
        return [to_header(v) for v in value] if value and dataclasses.is_dataclass(value[0]) \
            else value
    return to_header(value) if dataclasses.is_dataclass(value) else value


def from_header(cls: type, header: Any, where: str = "") -> Any:
    """Build `cls` from a decoded map, checking every field; raises ProtocolError."""
    if not isinstance(header, dict):
        what = f"field {where[:-1]!r}" if where else cls.__name__
        raise ProtocolError(f"{what} must be a map")
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _FIELDS[cls] = _field_checks(cls)
    if not fields.keys() >= header.keys():
        unknown = [k for k in header if k not in fields]
        raise ProtocolError(f"unknown field {where + str(unknown[0])[:64]!r}")
    values = {}
    for name, (check, required) in fields.items():
        if name in header:
            values[name] = check(header[name], where, name)
        elif required:
            raise ProtocolError(f"missing field {where + name!r}")
    return cls(**values)


_INT = {int}

# A field's check takes (value, where, name) and returns the value to keep; the field's name is
# formatted only for an error, since checks run for every item of every list.
Check = typing.Callable[[Any, str, Any], Any]
_FIELDS: dict[type, dict[str, tuple[Check, bool]]] = {}


def _field_checks(cls: type) -> dict[str, tuple[Check, bool]]:
    """name -> (check, required) for each field of `cls`, built once per class."""
    hints = typing.get_type_hints(cls)
    return {f.name: (_compile(hints[f.name], f.metadata or {}),
                     f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)}


def _compile(tp: Any, meta: Any) -> Check:
    max_len, lo, hi = meta.get("max_len"), meta.get("lo"), meta.get("hi")

    def fail(where: str, name: Any, what: str) -> typing.NoReturn:
        raise ProtocolError(f"field {where + str(name)!r} {what}")

    def in_range(v: Any, where: str, name: Any) -> Any:
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            fail(where, name, f"must be in [{lo}, {hi}], got {v}")
        return v

    def short(v: Any, where: str, name: Any) -> Any:
        if max_len is not None and len(v) > max_len:
            fail(where, name, f"is longer than {max_len}")
        return v

    if tp is int:
        def check_int(v: Any, where: str, name: Any) -> Any:
            if type(v) is not int:  # msgpack makes no int subclasses; a bool is not an int here
                fail(where, name, "must be an integer")
            return in_range(v, where, name) if lo is not None or hi is not None else v
        return check_int
    if tp is float:
        def check_float(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                fail(where, name, "must be a number")
            return in_range(float(v), where, name)
        return check_float
    if tp is bool:
        def check_bool(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, bool):
                fail(where, name, "must be a boolean")
            return v
        return check_bool
    if tp is str:
        def check_str(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, str):
                fail(where, name, "must be a string")
            return short(v, where, name)
        return check_str
    if tp is dict:
        def check_dict(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, dict):
                fail(where, name, "must be a map")
            _check_plain(v, f"{where}{name}")
            return v
        return check_dict
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        check_inner = _compile(inner, meta)

        def check_optional(v: Any, where: str, name: Any) -> Any:
            return None if v is None else check_inner(v, where, name)
        return check_optional
    if origin is list:
        (item,) = args
        check_item = _compile(item, {})

        def check_list(v: Any, where: str, name: Any) -> Any:
            if not isinstance(v, list):
                fail(where, name, "must be a list")
            short(v, where, name)
            if item is int:  # the hot case (token and page ids): one pass, items unlimited
                if set(map(type, v)) <= _INT:  # in C: 0.6 of a generator's time over 2k ids
                    return v
                bad = next(i for i, x in enumerate(v) if type(x) is not int)
                fail(f"{where}{name}", f"[{bad}]", "must be an integer")
            prefix = f"{where}{name}"
            return [check_item(x, prefix, f"[{i}]") for i, x in enumerate(v)]
        return check_list
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        def check_struct(v: Any, where: str, name: Any) -> Any:
            try:
                return msgspec.convert(v, tp)
            except msgspec.ValidationError as e:  # its path, from the outer message's root
                path, text = f"`$.{where}{name}", str(e)
                text = text.replace("`$", path, 1) if " - at `$" in text else f"{text} - at {path}`"
                raise invalid(msgspec.ValidationError(text)) from None
        return check_struct
    if dataclasses.is_dataclass(tp):
        def check_nested(v: Any, where: str, name: Any) -> Any:
            return from_header(tp, v, f"{where}{name}.")
        return check_nested
    raise TypeError(f"unsupported field type {tp!r}")  # a bug in this file, not bad input


def _check_plain(value: dict, name: str) -> None:
    """Only maps, lists and scalars: msgpack turns extension types (timestamps too) into objects."""
    stack: list[Any] = [value]
    while stack:  # not recursive: msgpack nests 1024 deep, past Python's recursion limit
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif not isinstance(item, (str, bytes, int, float, bool, type(None))):
            raise ProtocolError(f"field {name!r} holds a {type(item).__name__}")
