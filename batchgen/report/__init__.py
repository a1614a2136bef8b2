"""``batchgen report``: one self-contained HTML page about a job, from its output folder."""
from __future__ import annotations

import os
import tempfile
from typing import Any

from fsspec.core import split_protocol

from batchgen.report.data import ReportData, ReportError, load_report_data

SAMPLE_ROWS = 8  # rows shown whole-ish on the page, input excerpt and output

__all__ = ["ReportData", "ReportError", "build_report", "default_target", "write_report"]


def build_report(output: str, storage_options: dict[str, Any] | None = None) -> str:
    """The report page of the output folder ``output`` (local or any fsspec URL) as HTML text."""
    try:
        from batchgen.report.page import render_page  # matplotlib: only when a report is drawn
    except ImportError as e:
        raise ReportError(f"batchgen report needs matplotlib ({e}); install it with "
                          f"pip install 'matplotlib>=3.7'") from None
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
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".report-", suffix=".html")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a report is an ordinary file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target
