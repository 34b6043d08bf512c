"""What the collector finds unreachable: for tests that a path leaves no reference cycle."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def saved_garbage() -> Iterator[list[object]]:
    """The objects in reference cycles that became unreachable while the block ran.

    Collected once before (so earlier garbage is not counted) and once at the block's end; the
    list is filled then. The collector's debug flag is reset whatever happens.
    """
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    found: list[object] = []
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
