"""Validation of emitted messages against the official JSON Schemas: core 2026-07-28, the tasks extension, and
2025-11-25 for the SEP-1686 tasks the proxy serves to 2025-era clients."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

SCHEMA_DIR = Path(__file__).parent / "schema"
FILES = {"core": "mcp-2026-07-28.schema.json", "tasks": "ext-tasks.schema.json", "2025": "mcp-2025-11-25.schema.json"}


@functools.cache
def _document(which: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / FILES[which]).read_text())


@functools.cache
def _validator(which: str, definition: str) -> Draft202012Validator:
    document = _document(which)
    if definition not in document["$defs"]:
        raise KeyError(f"{definition} is not defined in {FILES[which]}")
    schema = {**document, "$ref": f"#/$defs/{definition}"}
    return Draft202012Validator(schema)


def validate(instance: Any, definition: str, which: str = "tasks") -> None:
    """Raise jsonschema.ValidationError unless `instance` is a valid `definition`."""
    _validator(which, definition).validate(instance)


def validate_response(message: dict[str, Any], result_definition: str, which: str = "tasks") -> None:
    """A JSON-RPC success response whose result is a `result_definition`."""
    validate(message, "JSONRPCResultResponse", "core")
    validate(message["result"], result_definition, which)


def validate_error(message: dict[str, Any], error_definition: str | None = None) -> None:
    """A JSON-RPC error response; `error_definition` names the core schema's specific error type.

    A null id (the request's id could not be read) is what JSON-RPC 2.0 prescribes, and the official SDKs send
    it, but the 2026 schema's RequestId has no null; such responses are checked without their id.
    """
    checked = {k: v for k, v in message.items() if not (k == "id" and v is None)}
    validate(checked, "JSONRPCErrorResponse", "core")
    if error_definition is None:
        return
    definition = _document("core")["$defs"][error_definition]
    validate(checked if "error" in definition.get("properties", {}) else checked["error"], error_definition, "core")
