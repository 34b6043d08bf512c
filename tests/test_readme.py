"""The README's configuration table is the settings model's."""

from __future__ import annotations

from pathlib import Path

from scripts.settings_table import BEGIN, END, table


def test_readme_configuration_table_matches_the_settings() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == table(), "run: python -m scripts.settings_table, paste in README"
