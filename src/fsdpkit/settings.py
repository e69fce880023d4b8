"""The typed config machine under both the trainer's options and the job spec.

Both are pydantic models built from `Settings`: frozen, unknown fields refused, every field with
its help text, range (`ge`/`le`) and choices (`Literal`). The scalar types below decide how a
YAML value or a command-line string becomes a value, the same way everywhere: `1.5` is no integer,
YAML's `true` is no number, `nan` is no learning rate, and an optional field takes `none`. `load`
turns pydantic's first complaint into one line naming the field and what it allows.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from fsdpkit.errors import UserError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("none", "null", "")


def fail(message: str) -> PydanticCustomError:
    """A validator's complaint; `describe` prefixes the field's path."""
    # The message travels as context: a template would read `{env, secret, key}` as placeholders.
    return PydanticCustomError("fsdpkit", "{m}", {"m": message})


def _to_bool(raw: Any) -> Any:
    if isinstance(raw, bool):
        return raw
    key = str(raw).strip().lower()
    if key in _TRUE:
        return True
    if key in _FALSE:
        return False
    raise fail(f"expected true or false, got {raw!r}")


def _to_int(raw: Any) -> Any:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
    raise fail(f"expected an integer, got {raw!r}")  # YAML's `true` is not the number 1


def _to_float(raw: Any) -> Any:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise fail(f"expected a number, got {raw!r}")
    try:
        value = float(raw)
    except ValueError:
        raise fail(f"expected a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise fail(f"expected a finite number, got {raw!r}")
    return value


def _to_str(raw: Any) -> Any:
    if raw is None or isinstance(raw, (dict, list)):
        raise fail(f"expected a string, got {raw!r}")
    return str(raw).lower() if isinstance(raw, bool) else str(raw)


Bool = Annotated[bool, BeforeValidator(_to_bool)]
Int = Annotated[int, BeforeValidator(_to_int)]
Float = Annotated[float, BeforeValidator(_to_float)]
Str = Annotated[str, BeforeValidator(_to_str)]


class NodeRange(NamedTuple):
    """Nodes of a job: a count, or an elastic MIN:MAX range."""

    min: int
    max: int

    @property
    def elastic(self) -> bool:
        return self.min != self.max

    def __str__(self) -> str:
        return f"{self.min}:{self.max}" if self.elastic else str(self.min)


def parse_nodes(raw: Any) -> NodeRange:
    """`2`, `"2"` or `"2:4"` as a NodeRange."""
    if isinstance(raw, NodeRange):
        return raw
    text = str(raw).strip()
    lo, sep, hi = text.partition(":")
    if isinstance(raw, bool) or not lo.isdigit() or (sep and not hi.isdigit()):
        raise fail(f"{text!r} must be a count (2) or an elastic range (MIN:MAX, such as 2:4)")
    nodes = NodeRange(int(lo), int(hi or lo))
    if nodes.min < 1 or nodes.max < nodes.min:
        raise fail(f"{text!r} must be >= 1, and MIN <= MAX")
    return nodes


# Written back as it is read: "2" or "2:4".
Nodes = Annotated[NodeRange, BeforeValidator(parse_nodes), PlainSerializer(str, return_type=str)]


def option(default: Any = None, help: str = "", *, ge: float | None = None, le: float | None = None,
           aliases: tuple[str, ...] = (), alias_values: dict[str, Any] | None = None, what: str = "allowed",
           default_factory: Any = None) -> Any:
    """A field with its help text and allowed range. `aliases` are other flag names for it (the
    reference FSDP example's); `alias_values` map a spelling to a value (`--bf16 1` -> "bf16");
    `what` names a choice in errors ("'nomad' is not a backend")."""
    extra: dict[str, Any] = {"aliases": list(aliases), "alias_values": dict(alias_values or {}), "what": what}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=extra)
    return Field(default, description=help, ge=ge, le=le, json_schema_extra=extra)


def _extra(f: FieldInfo) -> dict[str, Any]:
    return f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}


def aliases(f: FieldInfo) -> list[str]:
    return list(_extra(f).get("aliases", ()))


def scalar_type(f: FieldInfo) -> tuple[Any, bool]:
    """(scalar type, optional?) of a field: bool, int, float, str, a Literal, or a container."""
    tp, optional = f.annotation, False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        tp, optional = inner[0], len(inner) < len(typing.get_args(tp))
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp, optional


def section_of(cls: type[Settings], name: str) -> type[Settings]:
    """The Settings class of one of `cls`'s sections (a field whose type is itself Settings)."""
    section = cls.model_fields[name].annotation
    assert isinstance(section, type) and issubclass(section, Settings), name
    return section


def choices(f: FieldInfo) -> tuple[str, ...] | None:
    tp, _ = scalar_type(f)
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def bound(f: FieldInfo, name: str) -> float | None:
    """The field's `ge` or `le`, if it has one."""
    return next((getattr(m, name) for m in f.metadata if hasattr(m, name)), None)


class Settings(BaseModel):
    """A frozen, strictly-keyed section of settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _spellings(cls, raw: Any, info: Any) -> Any:
        """Spellings that mean a value (`--bf16 1`), and `none` for an optional field."""
        f = cls.model_fields[info.field_name]
        if isinstance(raw, (str, bool, int)):
            key = str(raw).strip().lower()
            spelled = _extra(f).get("alias_values", {})
            if key in spelled:
                return spelled[key]
            if isinstance(raw, str) and key in _NONE and scalar_type(f)[1]:
                return None
        return raw


def _model_at(cls: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class found by walking field names (and list indexes) from `cls`."""
    for part in loc:
        if isinstance(part, int):
            continue
        f = cls.model_fields.get(part)
        if f is None:
            return None
        tp, _ = scalar_type(f)
        while typing.get_origin(tp) in (list, dict):
            tp = typing.get_args(tp)[-1]
        if not (isinstance(tp, type) and issubclass(tp, BaseModel)):
            return None
        cls = tp
    return cls


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_BOUNDS = {"greater_than_equal": ("ge", ">="), "less_than_equal": ("le", "<="),
           "greater_than": ("gt", ">"), "less_than": ("lt", "<")}


def describe(e: ValidationError, cls: type[BaseModel], flat: bool = False) -> str:
    """pydantic's first complaint as one line: `path: what is wrong; what is allowed`. With `flat`,
    the path is the field's own name (the trainer's options are one flat namespace)."""
    err = e.errors(include_url=False)[0]
    loc, kind, raw = tuple(err["loc"]), err["type"], err.get("input")
    names = [p for p in loc if isinstance(p, str)]
    path = (names[-1] if names else cls.__name__) if flat else (_path(loc) or cls.__name__)
    if kind == "fsdpkit":
        return f"{path}: {err['ctx']['m']}"
    if kind in _BOUNDS:
        key, sign = _BOUNDS[kind]
        return f"{path}: {raw} is out of range; it must be {sign} {err['ctx'][key]}"
    parent = _model_at(cls, loc[:-1])
    if kind == "literal_error" and parent is not None:
        f = parent.model_fields[str(loc[-1])]
        allowed = ", ".join(choices(f) or ())
        return f"{path}: {raw!r} is not {_extra(f).get('what', 'allowed')}; choose one of: {allowed}"
    if kind == "extra_forbidden" and parent is not None:
        return f"{path}: unknown field; allowed: {', '.join(sorted(parent.model_fields))}"
    if kind == "missing":
        return f"{path}: required"
    if kind in ("model_type", "model_attributes_type"):
        model = _model_at(cls, loc)
        fields = f" of {', '.join(model.model_fields)}" if model else ""
        return f"{path}: expected a mapping{fields}, got {raw!r}"
    if kind == "dict_type":
        return f"{path}: expected a mapping, got {raw!r}"
    if kind == "list_type":
        return f"{path}: expected a list, got {raw!r}"
    return f"{path}: {err['msg']}"


M = typing.TypeVar("M", bound=BaseModel)


def load(cls: type[M], doc: dict[str, Any], flat: bool = False) -> M:
    """`cls` from a mapping, or a one-line UserError naming the first field that is wrong."""
    try:
        return cls.model_validate(doc)
    except ValidationError as e:
        raise UserError(describe(e, cls, flat)) from None
