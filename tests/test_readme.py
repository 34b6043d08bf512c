"""The configuration table (docs/configuration.md) is the settings model's."""

from __future__ import annotations

from pathlib import Path

from scripts.settings_table import BEGIN, END, table


def test_the_configuration_table_matches_the_settings() -> None:
    root = Path(__file__).parent.parent
    doc = (root / "docs" / "configuration.md").read_text()
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    assert doc[start:end] == table(), (
        "run: python -m scripts.settings_table, paste in docs/configuration.md"
    )
    assert "docs/configuration.md" in (root / "README.md").read_text()
