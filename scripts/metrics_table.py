"""Print the metrics table of docs/metrics.md (`python -m scripts.metrics_table`)."""

from __future__ import annotations

from app.observe.metrics import METRICS, MetricSpec

BEGIN = "<!-- metrics-table:begin -->"
END = "<!-- metrics-table:end -->"


def _row(spec: MetricSpec) -> str:
    kind = "histogram" if spec.kind == "batch_histogram" else spec.kind
    labels = ", ".join(spec.labels) or "(none)"
    meaning = spec.doc.replace("|", "\\|")
    return f"| `{spec.exported_name}` | {kind} | {labels} | {meaning} |"


def table() -> str:
    """The markdown table, between its markers."""
    rows = [BEGIN, "| Metric | Type | Labels | Meaning |", "| --- | --- | --- | --- |"]
    rows.extend(_row(spec) for spec in METRICS)
    rows.append(END)
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
