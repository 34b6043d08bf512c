"""Print the configuration table of docs/configuration.md (`python -m scripts.settings_table`)."""

from __future__ import annotations

import json
from typing import Any

from pydantic.fields import FieldInfo

from app.settings import Settings

BEGIN = "<!-- settings-table:begin -->"
END = "<!-- settings-table:end -->"


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if isinstance(value, tuple) and value and hasattr(value[0], "model_dump"):
        return "see below"
    if isinstance(value, tuple) and len(value) > 6:
        return f"{len(value)} bounds, {value[0]:g} to {value[-1]:g} s"
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return json.dumps(list(value)) if value else "(empty)"
    return str(value)


def table() -> str:
    """The markdown table, between its markers."""
    rows = [BEGIN, "| Variable | Default | Meaning |", "| --- | --- | --- |"]
    prefix = Settings.model_config.get("env_prefix", "")
    for name, field in Settings.model_fields.items():
        meaning = (field.description or "Histogram bucket bounds (JSON list of seconds).").replace(
            "|", "\\|"
        )
        rows.append(f"| `{prefix}{name.upper()}` | `{_default(field)}` | {meaning} |")
    rows.append(END)
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
