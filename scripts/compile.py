"""Compiles the gateway's per-request decision modules to C extensions with mypyc, in place.

``python -m scripts.compile`` builds :data:`COMPILED` beside their sources (``app/.../x.*.so``,
with the shared ``app/native__mypyc.*.so``), where Python imports them before the ``.py``;
``--check`` says which are missing or older than their source, and exits 1 if any is;
``--clean`` removes them. ``make install`` (and so ``make run`` and ``make test``) compiles
what changed; the Dockerfile compiles the image's. Intermediate files go to ``.run/mypyc``.

The modules are those that admission, routing and the relay's accounting run for every request
and every event: state and arithmetic on native classes, where mypyc's direct attribute access
and calls pay most (docs/dataplane.md has what each set saved). The relay's attempts and serving,
the front end and the wire stay interpreted: compiled, a variable narrowed inside ``try`` was read
with its narrowed type in ``finally`` (a TypeError where Python reads None).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
COMPILED: Final = (
    "app/admission/demand.py",
    "app/admission/limits.py",
    "app/admission/placement.py",
    "app/admission/room.py",
    "app/fleet/lease.py",
    "app/fleet/limiter.py",
    "app/fleet/predictor.py",
    "app/fleet/prefix.py",
    "app/fleet/routing.py",
    "app/fleet/workers.py",
    "app/relay/feedback.py",
    "app/relay/record.py",
    "app/relay/stream.py",
    "app/relay/answer.py",
    "app/observe/timing.py",
    "app/observe/goodput.py",
    "app/api/sse.py",
    "app/admission/ticket.py",
    "app/admission/fairshare.py",
    "app/admission/drain.py",
)
"""The modules compiled, as paths from the repository's root."""
GROUP: Final = "app.native"
"""The shared library every compiled module imports (``app/native__mypyc.*.so``)."""
BUILD: Final = ROOT / ".run" / "mypyc"


def built(source: str) -> list[Path]:
    """The extension modules built from ``source`` (none, or one per interpreter)."""
    path = ROOT / source
    return sorted(path.parent.glob(f"{path.stem}.*.so"))


def stale() -> list[str]:
    """The compiled modules whose extension is missing, or older than its source."""
    out = []
    for source in COMPILED:
        extensions = built(source)
        mtime = (ROOT / source).stat().st_mtime
        if not extensions or any(ext.stat().st_mtime < mtime for ext in extensions):
            out.append(source)
    return out


def clean() -> None:
    """Remove every extension module under ``app/``: this script builds all there are."""
    for ext in (ROOT / "app").rglob("*.so"):
        ext.unlink()


def compile_all() -> None:
    """Build every module of :data:`COMPILED` in place (mypyc, then the C compiler)."""
    from mypyc.build import mypycify  # the dev extra's mypy; only this command needs it
    from setuptools import setup

    # setup() reads pyproject.toml's [tool.setuptools] too, and warns that the table is beta.
    warnings.filterwarnings("ignore", message=r".*\[tool\.setuptools\].*beta")
    clean()  # a module dropped from the list must not leave its extension behind
    build = str(BUILD)
    steps = ["-q", "build_ext", "--inplace"]
    steps += ["--build-temp", f"{build}/temp", "--build-lib", f"{build}/lib"]
    setup(
        name="goodput-gateway-native",
        packages=[],
        ext_modules=mypycify(list(COMPILED), target_dir=build, group_name=GROUP),
        script_args=steps,
    )
    # setuptools keeps an unchanged extension's old time when it copies it in place: it is
    # built from the sources as they are now, and says so.
    for source in COMPILED:
        for ext in built(source):
            os.utime(ext)


def main(argv: Sequence[str] | None = None) -> int:
    """Compile, check or clean (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list stale modules; exit 1 if any")
    parser.add_argument("--clean", action="store_true", help="remove the compiled modules")
    args = parser.parse_args(argv)
    if args.clean:
        clean()
        return 0
    if args.check:
        missing = stale()
        for source in missing:
            print(f"not compiled, or older than its source: {source}")
        return 1 if missing else 0
    os.chdir(ROOT)  # mypycify takes the paths from the root
    compile_all()
    print(f"compiled {len(COMPILED)} modules with mypyc")
    return 0


if __name__ == "__main__":
    sys.exit(main())
