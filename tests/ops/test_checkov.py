"""checkov (infrastructure-as-code security scan) over the Dockerfile and the rendered overlays.

Findings are fixed, or skipped where they stand with a justification: ``# checkov:skip=ID:why``
in the Dockerfile, a ``checkov.io/skipN: ID=why`` annotation in a manifest (annotations survive
kustomize rendering, comments do not).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.ops.support import OVERLAYS, REPO, kustomize_build, tool


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One checkov run (it takes seconds to start) over everything, as JSON reports."""
    scan = tmp_path_factory.mktemp("checkov")
    shutil.copy(REPO / "Dockerfile", scan / "Dockerfile")
    for overlay in OVERLAYS:
        (scan / f"{overlay}.yaml").write_text(kustomize_build(overlay))
    result = subprocess.run(
        [
            tool("checkov"),
            "--directory",
            str(scan),
            "--framework",
            "dockerfile",
            "kubernetes",
            "--output",
            "json",
            "--compact",
            # No network: no Prisma Cloud guidelines, no external modules.
            "--skip-download",
            "--download-external-modules",
            "false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=scan,
        env={"PATH": "/usr/bin:/bin", "HOME": str(scan), "LOG_LEVEL": "WARNING"},
    )
    assert result.stdout.strip(), result.stderr
    parsed = json.loads(result.stdout)
    found: list[dict[str, Any]] = parsed if isinstance(parsed, list) else [parsed]
    return found


def _checks(reports: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [check for report in reports for check in report["results"][kind]]


def test_both_frameworks_were_scanned(reports: list[dict[str, Any]]) -> None:
    scanned = {report["check_type"] for report in reports}
    assert scanned == {"dockerfile", "kubernetes"}
    passed = _checks(reports, "passed_checks")
    files = {Path(check["file_path"]).name for check in passed}
    assert files == {"Dockerfile", *(f"{overlay}.yaml" for overlay in OVERLAYS)}


def test_no_failed_checks(reports: list[dict[str, Any]]) -> None:
    failed = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({Path(c['file_path']).name})"
        for c in _checks(reports, "failed_checks")
    ]
    assert not failed, "\n".join(failed)


def test_every_skip_is_justified(reports: list[dict[str, Any]]) -> None:
    for check in _checks(reports, "skipped_checks"):
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason.split()) >= 3, f"{check['check_id']} skipped without a reason"
