"""The fields and shapes in request bodies: what docs/clients.md's table and the fixtures come from.

`body_shapes(body)` walks a JSON body and names every field path it holds (`messages[].content[].type`),
with the values of the fields that select a kind (`type`, `role`, ...) and the kind of every other
leaf, but none of the text. JSON Schemas (a tool's `input_schema` or `parameters`, a response
format's `schema`) are reduced to the keywords they use, since that is what a grammar compiler sees.
Run on the captures of client_capture.py to list them; the tests run it on the synthetic fixtures
to check that each keeps the captured shapes (tests/data/client_bodies/*.json).

    python tests/client_fields.py /tmp/capture/claude /tmp/capture/codex ...
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Fields whose value is a kind rather than content: their values are part of the shape
KIND_FIELDS = {"type", "role", "effort", "summary", "verbosity", "tool_choice", "wire_api", "truncation",
               "service_tier", "include", "encoding_format", "detail", "status", "reasoning_effort", "mode"}
SCHEMA_FIELDS = {"input_schema", "parameters", "schema"}
OPAQUE_FIELDS = {"input", "arguments"}


def _schema_keywords(schema: Any, out: set[str]) -> None:
    if isinstance(schema, dict):
        for key, value in schema.items():
            out.add(key)
            if key in ("properties", "$defs", "definitions", "patternProperties"):
                for sub in value.values() if isinstance(value, dict) else ():
                    _schema_keywords(sub, out)
            else:
                _schema_keywords(value, out)
    elif isinstance(schema, list):
        for item in schema:
            _schema_keywords(item, out)


def _leaf(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if value is None:
        return "null"
    return {int: "int", float: "number", str: "string"}.get(type(value), type(value).__name__)


def body_shapes(body: Any, path: str = "") -> set[str]:
    """Every `path: kind` in `body`; kinds of KIND_FIELDS are their values (`tools[].type=function`)."""
    shapes: set[str] = set()
    if isinstance(body, dict):
        if not body and path:
            shapes.add(f"{path}: {{}}")
        for key, value in body.items():
            sub = f"{path}.{key}" if path else key
            if key in SCHEMA_FIELDS and isinstance(value, dict) and path != "":
                keywords: set[str] = set()
                _schema_keywords(value, keywords)
                shapes.add(f"{sub}: schema({','.join(sorted(keywords))})")
            elif key in OPAQUE_FIELDS and isinstance(value, dict) and path.endswith("[]"):
                shapes.add(f"{sub}: object")  # a tool call's arguments: the tool's fields, not the API's
            elif key in KIND_FIELDS and isinstance(value, str):
                shapes.add(f"{sub}={value}")
            elif key in KIND_FIELDS and isinstance(value, list) and all(isinstance(v, str) for v in value):
                shapes.add(f"{sub}=[{','.join(sorted(set(value)))}]")
            else:
                shapes |= body_shapes(value, sub)
    elif isinstance(body, list):
        if not body:
            shapes.add(f"{path}: []")
        for item in body:
            shapes |= body_shapes(item, f"{path}[]")
    else:
        shapes.add(f"{path}: {_leaf(body)}")
    return shapes


def captured(folders: Iterable[Path]) -> dict[tuple[str, str], set[str]]:
    """(method, path) -> the union of the shapes of every captured body sent there."""
    out: dict[tuple[str, str], set[str]] = {}
    for folder in folders:
        for file in sorted(Path(folder).glob("*.json")):
            entry = json.loads(file.read_text())
            shapes = body_shapes(entry["body"]) if entry["body"] is not None else set()
            out.setdefault((entry["method"], entry["path"]), set()).update(shapes)
    return {key: merge_schemas(shapes) for key, shapes in out.items()}


def merge_schemas(shapes: set[str]) -> set[str]:
    """One `path: schema(...)` per path, with the union of the keywords of all its schemas."""
    keywords: dict[str, set[str]] = {}
    rest = set()
    for shape in shapes:
        path, sep, kind = shape.partition(": schema(")
        if sep:
            keywords.setdefault(path, set()).update(k for k in kind.rstrip(")").split(",") if k)
        else:
            rest.add(shape)
    return rest | {f"{path}: schema({','.join(sorted(words))})" for path, words in keywords.items()}


def main() -> None:
    for folder in sys.argv[1:]:
        print(f"# {folder}")
        for (method, path), shapes in sorted(captured([Path(folder)]).items()):
            print(f"{method} {path}")
            for shape in sorted(shapes):
                print(f"  {shape}")


if __name__ == "__main__":
    main()
