"""Inline local JSON Schema `$ref`s so tool arguments are converted by their real type.

Stock vLLM's argument coercion reads `type` from each property schema and treats a
property that only says `{"$ref": "#/$defs/Unit"}` as a string. Resolving the
references inside each tool's `parameters` (against its own `$defs` or
`definitions`) before the parser sees the tools fixes that without touching vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def _lookup_pointer(root: Any, ref: str) -> Any | None:
    # Only document-local references ("#/..."); remote ones stay unresolved.
    if not ref.startswith("#/"):
        return None
    node = root
    for raw_part in ref[2:].split("/"):
        part = raw_part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def resolve_local_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `schema` with local `$ref`s replaced by their targets.

    Sibling keywords next to a `$ref` win over the target's. A reference that is
    already being expanded (a recursive schema) is left as `$ref`, so the
    result is finite; unknown references are left as they are.
    """

    def walk(node: Any, expanding: tuple[str, ...]) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in expanding:
                target = _lookup_pointer(schema, ref)
                if isinstance(target, dict):
                    merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
                    return walk(merged, (*expanding, ref))
            return {key: walk(value, expanding) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(item, expanding) for item in node]
        return node

    resolved = walk(schema, ())
    return resolved if isinstance(resolved, dict) else schema


def _has_ref(schema: object) -> bool:
    try:
        return '"$ref"' in json.dumps(schema)
    except (TypeError, ValueError):
        return False


def _with_resolved_parameters(tool: Any) -> Any:
    # Chat Completions tools carry `function.parameters`; Responses function tools
    # carry `parameters`. Both are pydantic models with `model_copy`.
    function = getattr(tool, "function", None)
    if function is not None:
        params = getattr(function, "parameters", None)
        if isinstance(params, dict) and _has_ref(params):
            new_function = function.model_copy(update={"parameters": resolve_local_refs(params)})
            return tool.model_copy(update={"function": new_function})
        return tool
    params = getattr(tool, "parameters", None)
    if isinstance(params, dict) and _has_ref(params) and hasattr(tool, "model_copy"):
        return tool.model_copy(update={"parameters": resolve_local_refs(params)})
    if isinstance(tool, dict):
        inner = tool.get("function")
        if isinstance(inner, dict) and isinstance(inner.get("parameters"), dict) and _has_ref(inner["parameters"]):
            return {**tool, "function": {**inner, "parameters": resolve_local_refs(inner["parameters"])}}
    return tool


def resolve_tool_refs(tools: Sequence[Any] | None) -> list[Any] | None:
    """Tools with `$ref`s in their parameters inlined; tools without refs are returned as they are."""
    if not tools:
        return None if tools is None else list(tools)
    resolved: list[Any] = []
    for tool in tools:
        try:
            resolved.append(_with_resolved_parameters(tool))
        except Exception:
            # A schema we cannot rewrite keeps stock behaviour (values stay strings).
            resolved.append(tool)
    return resolved


def unresolved_local_refs(schema: dict[str, Any]) -> list[str]:
    """Local `$ref`s ("#/...") in `schema` that point nowhere."""
    missing: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref != "#" and _lookup_pointer(schema, ref) is None:
                missing.append(ref)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(schema)
    return missing


def tool_parameters(tool: Any) -> tuple[str, dict[str, Any] | None]:
    """(function name, parameters schema) of a Chat Completions or Responses function tool."""
    function = getattr(tool, "function", None)
    if function is None and isinstance(tool, dict):
        function = tool.get("function", tool)
    if isinstance(function, dict):
        name, params = function.get("name"), function.get("parameters")
    elif function is not None:
        name, params = getattr(function, "name", None), getattr(function, "parameters", None)
    else:
        name, params = getattr(tool, "name", None), getattr(tool, "parameters", None)
    return str(name or ""), params if isinstance(params, dict) else None
