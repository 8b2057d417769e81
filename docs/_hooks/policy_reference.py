"""MkDocs hook: the policy reference page, generated from the configuration model at every build, so that it
cannot drift from the code (every key, its type, default, the flag and environment variable that override it, and
the docstring under the field as its description)."""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

from mkdocs.structure.files import File, Files
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from mcp_tasks_proxy.__main__ import OVERRIDES
from mcp_tasks_proxy.config import ENV_PREFIX, ProxyConfig, section_model

PAGE = "policy-reference.md"

INTRO = """# Policy reference

Every key of the policy file, generated from the proxy's configuration model (`proxy/config.py`) when this site is
built. A key not listed here is an error that names it. Precedence, the later winning: embedded defaults <
`--defaults` file < `--config` file < environment < flags. How to write a policy: [The policy file](policy.md).
"""


def on_config(config: Any) -> Any:
    """The version this site documents, in every page's footer (the package's, as `mcp-tasks-proxy --version` says)."""
    from mcp_tasks_proxy import __version__

    config["copyright"] = f"mcp-tasks-proxy {__version__} · Apache-2.0"
    return config


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, PAGE, content=render()))
    return files


def render() -> str:
    overrides = {path: (flag, suffix) for flag, path, suffix, _ in OVERRIDES}
    out = [INTRO]
    for path, model in _sections(ProxyConfig, ""):
        out.append(f"## `{path or 'top level'}`\n")
        doc = (model.__doc__ or "").strip()
        if doc and model is not ProxyConfig:
            out.append(" ".join(doc.split()) + "\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            description = " ".join((field.description or "").split())
            if section_model(field.annotation) is not None:
                sub = key + ("[]" if typing.get_origin(field.annotation) is list else "")
                description = f"{description} See [`{sub}`](#{_anchor(sub)}).".strip()
            if key in overrides:
                flag, suffix = overrides[key]
                description += f" Flag `--{flag.replace('_', '-')}`, environment `{ENV_PREFIX}{suffix}`."
            row = [f"`{name}`", _type(field.annotation, field), _default(field), description.replace("|", "\\|")]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def _sections(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    found = [(path, model)]
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        if sub is not None:
            key = f"{path}.{name}" if path else name
            found += _sections(sub, key + ("[]" if typing.get_origin(field.annotation) is list else ""))
    return found


def _anchor(key: str) -> str:
    """Python-Markdown's slug of a `## `key`` heading."""
    return "".join(c for c in key.lower() if c.isalnum() or c in "_-")


def _type(annotation: Any, field: FieldInfo | None = None) -> str:
    text = _type_name(annotation)
    bounds = []
    for constraint in field.metadata if field is not None else ():
        for attribute, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥")):
            value = getattr(constraint, attribute, None)
            if value is not None:
                bounds.append(f"{sign} {value}")
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _type_name(annotation: Any) -> str:
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(arguments[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in arguments)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in arguments)
    if origin is list:
        return f"list of {_type_name(arguments[0])}"
    if origin is dict:
        return f"map of {_type_name(arguments[0])} to {_type_name(arguments[1])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{json.dumps(m.value)}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "AnyHttpUrl": "URL"}.get(
        getattr(annotation, "__name__", ""), f"{getattr(annotation, '__name__', annotation)}"
    )


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "none"
    return f"`{json.dumps(value, default=str)}`"
