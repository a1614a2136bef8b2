"""``batchgen report``: one self-contained HTML page about a job, from its output folder."""
from __future__ import annotations

import os
from typing import Any

from fsspec.core import split_protocol

from batchgen.io.atomic import atomic_open
from batchgen.report.data import ReportData, ReportError, load_report_data

SAMPLE_ROWS = 8  # rows shown whole-ish on the page, input excerpt and output

__all__ = ["ReportData", "ReportError", "build_report", "default_target", "write_report"]


def build_report(output: str, storage_options: dict[str, Any] | None = None) -> str:
    """The report page of the output folder ``output`` (local or any fsspec URL) as HTML text."""
    from batchgen.report.page import render_page  # matplotlib: only when a report is drawn
    from batchgen.report.show import sample_rows

    data = load_report_data(output, storage_options)
    samples = sample_rows(output, SAMPLE_ROWS, storage_options=storage_options) if data.parts else []
    return render_page(data, samples)


def default_target(output: str) -> str:
    """report.html inside a local output folder, else in the current folder."""
    protocol, path = split_protocol(output)
    return os.path.join(path, "report.html") if protocol in (None, "file", "local") else "report.html"


def write_report(output: str, target: str | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """Writes the report to ``target`` (a local file, replaced whole); returns its path."""
    page = build_report(output, storage_options)
    target = target or default_target(output)
    with atomic_open(os.path.abspath(target), "w", encoding="utf-8") as f:
        f.write(page)
    return target
