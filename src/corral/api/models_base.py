"""What every wire model shares: the base class, the rules several models
check (paths, layer references, users, environments), and the conversion
of pydantic's error into the InvalidArgument a caller sees.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from corral.errors import InvalidArgument

MiB = 1024 * 1024
GiB = 1024 * MiB

ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
USER = re.compile(r"^(?:[a-z_][a-z0-9_.-]{0,31}|\d{1,10}(?::\d{1,10})?)$")
REF = re.compile(
    r"^[a-z0-9][a-z0-9._/-]{0,127}(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$|^sha256:[0-9a-f]{64}$"
)
REF_RULE = "must be a layer reference like 'name:tag' or 'sha256:<64 hex>'"
PATH_RULE = "must be an absolute path inside the sandbox, without '..' or NUL"


def check_path(value: object, field: str = "path") -> str:
    """An absolute, '..'-free path, normalised ('//' and '.' collapsed)."""
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise InvalidArgument(field, PATH_RULE, value)
    if ".." in value.split("/") or len(value) > 4096:
        raise InvalidArgument(field, PATH_RULE, value)
    return posixpath.normpath(value).replace("//", "/")


def check_ref(value: object, field: str) -> str:
    if not isinstance(value, str) or not REF.match(value):
        raise InvalidArgument(field, REF_RULE, value)
    return value


CPU_CLASSES = ("interactive", "background")


def check_cpu_class(value: str) -> str:
    if value not in CPU_CLASSES:
        raise ValueError("must be 'interactive' (an agent waits on it) or 'background'")
    return value


def check_env(value: dict[str, str]) -> dict[str, str]:
    """Environment variables: names a shell accepts, values without NUL."""
    for k, v in value.items():
        if not ENV_KEY.match(k):
            raise ValueError(f"key {k!r} must match [A-Za-z_][A-Za-z0-9_]*")
        if "\x00" in v or len(v) > 128 * 1024:
            raise ValueError(f"value of {k!r} must be under 128 KiB and hold no NUL")
    if len(value) > 1024:
        raise ValueError("at most 1024 variables")
    return value


_M = TypeVar("_M", bound=BaseModel)


class StrictModel(BaseModel):
    """A model whose unknown fields are refused, not dropped: a misspelt
    option is an error, never silently the default."""

    model_config = ConfigDict(extra="forbid")


def validated(model: type[_M], data: dict[str, Any]) -> _M:
    """Build a model, turning pydantic's error into InvalidArgument."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_from_pydantic(exc) from None


def invalid_from_pydantic(exc: ValidationError) -> InvalidArgument:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "request"
    rule = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        rule = "is not a known field"
    return InvalidArgument(field, rule, first.get("input"))
