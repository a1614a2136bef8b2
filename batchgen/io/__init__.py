"""Reading and writing Parquet/JSONL on fsspec URLs, and the output commit protocol."""

from batchgen.io.errors import InputError, OutputError
from batchgen.io.paths import expand_inputs, read_bytes, redact, storage_options_for
from batchgen.io.folder import OutputFolder, read_output
from batchgen.io.readers import InputRow, count_rows, read_columns, read_rows, row_labels
from batchgen.io.writer import OutputWriter

__all__ = [
    "InputError",
    "InputRow",
    "OutputError",
    "OutputFolder",
    "OutputWriter",
    "count_rows",
    "expand_inputs",
    "read_bytes",
    "read_columns",
    "read_output",
    "read_rows",
    "redact",
    "row_labels",
    "storage_options_for",
]
