"""`${VAR}` substitution in the configuration, before any value is parsed.

`${VAR}` anywhere inside a string value is replaced by the environment variable at load time;
a missing variable is an error naming it. `${VAR:-default}` uses `default` when VAR is unset
or empty (shell semantics); `$${` writes a literal `${`. A string that took a value from the
environment comes back as `Substituted`, so messages never show it and numeric parsers accept
it (`port: ${PORT:-8080}`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gateway.settings.parse import Substituted, join

_REFERENCE = re.compile(r"\$\$\{|\$\{([^{}]*)\}|\$\{")
_REFERENCE_BODY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?", re.DOTALL)


def substitute(node: object, path: str, env: Mapping[str, str], errors: list[str]) -> object:
    """Return a copy of the YAML tree with `${...}` replaced in every string value."""
    if isinstance(node, dict):
        return {k: substitute(v, join(path, k), env, errors) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute(v, f"{path}[{i}]", env, errors) for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node
    replaced = False
    variables: list[str] = []

    def replace(match: re.Match[str]) -> str:
        nonlocal replaced
        if match.group(0) == "$${":
            return "${"
        body = match.group(1)
        parsed = _REFERENCE_BODY.fullmatch(body) if body is not None else None
        if parsed is None:
            errors.append(f"{path}: malformed reference {match.group(0)!r}; use ${{NAME}}")
            return ""
        replaced = True
        variable, default = parsed.group(1), parsed.group(2)
        variables.append(variable)
        value = env.get(variable)
        if default is not None:
            return value if value else default
        if value is None:
            errors.append(f"{path}: environment variable {variable} is not set")
            return ""
        return value

    result = _REFERENCE.sub(replace, node)
    return Substituted.of(result, tuple(dict.fromkeys(variables))) if replaced else result
