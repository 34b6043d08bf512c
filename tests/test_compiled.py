"""The decision modules run compiled (scripts/compile.py), as the image and `make run` run them."""

from __future__ import annotations

import importlib
from importlib.machinery import EXTENSION_SUFFIXES

from scripts.compile import COMPILED


def test_every_listed_module_is_imported_from_its_extension() -> None:
    for source in COMPILED:
        name = source.removesuffix(".py").replace("/", ".")
        origin = importlib.import_module(name).__file__ or ""
        assert origin.endswith(tuple(EXTENSION_SUFFIXES)), f"{name} runs from {origin}"
