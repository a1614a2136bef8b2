"""Streaming readers for Parquet and JSONL inputs, one InputRow at a time, in bounded memory."""

from __future__ import annotations

import json
import posixpath
import threading
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import infer_compression

from batchgen.crashpoints import crash_point
from batchgen.io.errors import InputError
from batchgen.io.paths import filesystem, redact
from batchgen.io.retry import is_transient, retry, will_retry
from batchgen.io.row_values import SURROGATE_ESCAPE, Unconvertible, holds_surrogate, row_sizes, to_pylist

__all__ = ["InputRow", "read_rows", "read_columns", "count_rows", "detect_format", "row_labels"]

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_FORMAT_ALIASES = {"parquet": "parquet", "pq": "parquet",
                   "jsonl": "jsonl", "json": "jsonl", "ndjson": "jsonl", "openai": "jsonl"}
_COLUMN_SAMPLE_OBJECTS = 100
_COLUMN_SAMPLE_LINES = 1000
_COLUMN_SEARCH_LINES = 100_000  # lines searched for a wanted column the sample lacks (a typo reads no further)
DEFAULT_MAX_ROW_BYTES = 32 << 20
_READ_CHUNK = 1 << 20  # JSONL read size
# Parquet row groups up to this many compressed bytes are read whole (few requests); larger ones are
# streamed a few MiB per column at a time, so memory does not grow with the row group.
_PREBUFFER_LIMIT = 64 << 20
_STREAM_BUFFER = 4 << 20


@dataclass
class InputRow:
    """One input row. error is set for a line that could not be parsed (values is {} then) and for
    a row lacking its id column (values kept, row_id is the default "<file>:<index>")."""

    row_id: str
    values: dict[str, Any]
    source: str
    index: int
    error: str | None = None


def detect_format(url: str, fmt: str = "auto") -> str:
    """'parquet' or 'jsonl' for url: fmt when given, else from the extension (after .gz etc.)."""
    if fmt != "auto":
        try:
            return _FORMAT_ALIASES[fmt.lower()]
        except KeyError:
            raise InputError(f"unknown input format {fmt!r}; use parquet, jsonl or openai") from None
    name = url.lower()
    if infer_compression(name):
        name = name.rsplit(".", 1)[0]
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise InputError(redact(f"cannot tell the format of {url} from its extension; set the input format"))


def row_labels(files: list[str]) -> dict[str, str]:
    """Stable per-file labels for default row ids: basenames, or paths relative to the common folder
    when two files share a basename. They depend on the set of files alone, never on reading order."""
    bases = {f: posixpath.basename(f.rstrip("/")) for f in files}
    if len(set(bases.values())) == len(files):
        return bases
    try:
        common = posixpath.commonpath([f.split("://", 1)[-1] for f in files])
    except ValueError:  # absolute and relative paths mixed: no common folder
        return {f: f for f in files}
    return {f: posixpath.relpath(f.split("://", 1)[-1], common) if common else f for f in files}


@dataclass
class Oversized:
    """A JSONL line or Parquet row over the byte limit, skipped without being held in memory."""

    size: int
    limit: int


def _open(url: str, storage_options: dict | None, compression: str | None = None, **kwargs: Any):
    fs, path = filesystem(url, storage_options)
    try:
        return retry(lambda: fs.open(path, "rb", compression=compression, **kwargs), what=f"open {url}")
    except FileNotFoundError:
        raise InputError(redact(f"input file not found: {url}")) from None
    except Exception as exc:
        raise InputError(redact(f"cannot open input {url}: {type(exc).__name__}: {exc}")) from exc


def _resumable(url: str, produce: Callable[[int], Iterator[Any]], what: str) -> Generator[Any, None, None]:
    """Yield from produce(skip), reopening after transient errors and skipping what was yielded: the retry of
    a stream's reads (each is one request, tried once), with io.retry's policy."""
    done, attempt = 0, 1
    while True:
        try:
            for item in produce(done):
                done += 1
                yield item
            return
        except InputError:
            raise
        except Exception as exc:
            if not will_retry(exc, attempt, f"read {what} {url}"):
                raise InputError(redact(f"cannot read {what} {url}: {type(exc).__name__}: {exc}")) from exc
            attempt += 1


def bounded_lines(f: Any, max_bytes: int) -> Iterator[bytes | Oversized]:
    """The lines of a binary file, each one held whole only up to max_bytes: a longer line is read past in
    chunks and comes out as Oversized. Memory: max_bytes plus about two read chunks."""
    buf = bytearray()
    over = 0  # bytes seen so far of a line over the limit
    while chunk := f.read(_READ_CHUNK):
        view, start = memoryview(chunk), 0
        while start < len(chunk):
            newline = chunk.find(b"\n", start)
            end = newline + 1 if newline >= 0 else len(chunk)
            begin, start = start, end
            if over or len(buf) + end - begin > max_bytes:
                over += len(buf) + end - begin
                buf.clear()
            elif newline >= 0 and not buf:
                yield chunk[begin:end]  # the common case: a whole line inside one chunk
                continue
            else:
                buf += view[begin:end]
            if newline >= 0:
                yield Oversized(over, max_bytes) if over else bytes(buf)
                over = 0
                buf.clear()
    if over:
        yield Oversized(over, max_bytes)
    elif buf:
        yield bytes(buf)


def _jsonl_lines(url: str, storage_options: dict | None, max_bytes: int
                 ) -> Generator[bytes | Oversized, None, None]:
    """Every raw line of a (possibly compressed) JSONL file, blank and malformed ones included."""
    compression = infer_compression(url)

    def produce(skip: int) -> Iterator[bytes | Oversized]:
        with _open(url, storage_options, compression) as f:
            for lineno, raw in enumerate(bounded_lines(f, max_bytes)):
                if lineno >= skip:
                    yield raw

    return _resumable(url, produce, "JSONL file")


def _too_long(what: str, big: Oversized) -> str:
    return f"{what} is {big.size} bytes, more than the limit of {big.limit} (max_row_bytes); it was not read"


def _decode(raw: bytes, lineno: int) -> str:
    return raw.decode("utf-8-sig" if lineno == 0 else "utf-8")


def _is_blank(raw: bytes | Oversized, lineno: int) -> bool:
    """A line with nothing but whitespace (Unicode spaces and a leading BOM included): not a row."""
    if isinstance(raw, Oversized):
        return False
    stripped = raw.strip()
    if not stripped:
        return True
    if len(stripped) > 16:  # a shortcut: no real file pads a line with that many Unicode spaces
        return False
    try:
        return not _decode(raw, lineno).strip()
    except UnicodeDecodeError:
        return False


def _parse_line(raw: bytes | Oversized, url: str, lineno: int) -> tuple[dict | None, str | None]:
    """(object, None), (None, error) or (None, None) for a blank line."""
    if _is_blank(raw, lineno):
        return None, None
    where = f"{redact(url)} line {lineno + 1}"
    if isinstance(raw, Oversized):
        return None, f"{where}: {_too_long('the line', raw)}"
    try:
        text = _decode(raw, lineno)
    except UnicodeDecodeError as exc:
        return None, f"{where}: invalid UTF-8 at byte {exc.start}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"{where}: malformed JSON: {exc.msg} at column {exc.colno}"
    except RecursionError:
        return None, f"{where}: JSON nested too deeply to read"
    if not isinstance(obj, dict):
        return None, f"{where}: expected a JSON object, got {type(obj).__name__}"
    if SURROGATE_ESCAPE.search(text) and holds_surrogate(obj):
        return None, f"{where}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape outside a pair), not text"
    return obj, None


def _jsonl_records(url: str, storage_options: dict | None, max_bytes: int
                   ) -> Iterator[tuple[int, dict, str | None]]:
    for lineno, raw in enumerate(_jsonl_lines(url, storage_options, max_bytes)):
        obj, error = _parse_line(raw, url, lineno)
        if obj is not None or error is not None:
            yield lineno, obj or {}, error


def _batch_rows(batch: pa.RecordBatch, max_bytes: int) -> Iterator[dict | Oversized | Unconvertible]:
    """The rows of a record batch as dicts; those over max_bytes as Oversized, never converted."""
    if batch.nbytes <= max_bytes:
        yield from to_pylist(batch)
        return
    sizes = row_sizes(batch)
    keep = [size <= max_bytes for size in sizes]
    small = iter(to_pylist(batch.filter(pa.array(keep))))
    for size, ok in zip(sizes, keep):
        yield next(small) if ok else Oversized(size, max_bytes)


def _parquet_file(f: Any, url: str) -> pq.ParquetFile:
    """A ParquetFile that reads row groups whole when they are small and streams the large ones."""
    try:
        pf = pq.ParquetFile(f)
    except Exception as exc:
        if is_transient(exc):
            raise
        raise InputError(redact(f"corrupt or unreadable Parquet file {url}: {exc}")) from exc
    md = pf.metadata
    largest = max((sum(md.row_group(g).column(c).total_compressed_size for c in range(md.num_columns))
                   for g in range(md.num_row_groups)), default=0)
    if largest <= _PREBUFFER_LIMIT:
        return pf
    return pq.ParquetFile(f, metadata=md, pre_buffer=False, buffer_size=_STREAM_BUFFER)


def _parquet_records(url: str, storage_options: dict | None, batch_rows: int, max_bytes: int
                     ) -> Iterator[tuple[int, dict, str | None]]:
    def produce(skip: int) -> Iterator[dict | Oversized]:
        # no read-ahead cache: streamed columns read from far-apart offsets in turn
        with _open(url, storage_options, cache_type="none") as f:
            pf = _parquet_file(f, url)
            first, start = 0, 0
            while first < pf.num_row_groups and start + pf.metadata.row_group(first).num_rows <= skip:
                start += pf.metadata.row_group(first).num_rows
                first += 1
            if first == pf.num_row_groups:
                return
            to_skip = skip - start
            groups = list(range(first, pf.num_row_groups))
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=groups):
                if to_skip >= batch.num_rows:
                    to_skip -= batch.num_rows
                    continue
                if to_skip:
                    batch, to_skip = batch.slice(to_skip), 0
                yield from _batch_rows(batch, max_bytes)

    for index, values in enumerate(_resumable(url, produce, "Parquet file")):
        if isinstance(values, Oversized):
            yield index, {}, f"{redact(url)} row {index}: {_too_long('the row', values)}"
        elif isinstance(values, Unconvertible):
            yield index, values.values, f"{redact(url)} row {index}: column {values.column!r} cannot be read: " \
                                        f"{values.reason}"
        else:
            yield index, values, None


def _parquet_footer(url: str, storage_options: dict | None) -> pq.FileMetaData:
    """The file's footer (schema, row counts) without reading any data pages."""
    with _open(url, storage_options) as f:
        try:
            return pq.read_metadata(f)
        except Exception as exc:
            raise InputError(redact(f"corrupt or unreadable Parquet file {url}: {exc}")) from exc


def read_rows(
    files: list[str],
    fmt: str = "auto",
    storage_options: dict | None = None,
    id_column: str | None = None,
    batch_rows: int = 1024,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    labels: dict[str, str] | None = None,
) -> Iterator[InputRow]:
    """Stream the rows of files in order.

    Unparseable JSONL lines become error rows and the stream goes on; a missing or corrupt file
    raises InputError. Without id_column, row ids are "<file label>:<row index>", where the label is
    the basename (or the path relative to the files' common folder when basenames collide). A row
    whose id_column is missing or null keeps its values, gets the default id and an error; so does a
    JSONL line or Parquet row over max_row_bytes, which is never parsed. A reader of some of a job's files
    (a shard) passes ``labels``, the ``row_labels`` of all of them, so that its ids are the job's ids.
    """
    names = labels if labels is not None else row_labels(list(files))
    for url in files:
        kind = detect_format(url, fmt)
        records = (_parquet_records(url, storage_options, batch_rows, max_row_bytes) if kind == "parquet"
                   else _jsonl_records(url, storage_options, max_row_bytes))
        for index, values, error in records:
            crash_point("read_row")
            row_id = f"{names[url]}:{index}"
            if id_column is not None and (error is None or values.get(id_column) is not None):
                value = values.get(id_column)
                if value is None:
                    where = f"line {index + 1}" if kind == "jsonl" else f"row {index}"
                    error = f"{redact(url)} {where}: id column {id_column!r} is missing or null"
                else:
                    row_id = str(value)
            yield InputRow(row_id=row_id, values=values, source=url, index=index, error=error)


def read_columns(files: list[str], fmt: str = "auto", storage_options: dict | None = None,
                 wanted: frozenset[str] = frozenset()) -> set[str]:
    """Column names available across files: Parquet schemas, keys of the first JSONL objects (and of later ones
    that hold a ``wanted`` key the first ones lack)."""
    columns: set[str] = set()
    for url in files:
        if detect_format(url, fmt) == "parquet":
            columns.update(_parquet_footer(url, storage_options).schema.to_arrow_schema().names)
            continue
        columns.update(_jsonl_columns(url, storage_options, wanted))
    return columns


def _jsonl_columns(url: str, storage_options: dict | None, wanted: frozenset[str] = frozenset()) -> set[str]:
    """The keys of a JSONL file's first objects; where they lack a ``wanted`` key, the file is read on until a line
    holds it (only lines whose bytes name it are parsed), up to _COLUMN_SEARCH_LINES lines. Raises InputError when none of its first lines is a JSON
    object (a file that is not JSON Lines at all, not one with a few bad lines)."""
    columns: set[str] = set()
    seen, first_error, lineno = 0, None, -1
    with closing(_jsonl_lines(url, storage_options, DEFAULT_MAX_ROW_BYTES)) as lines:
        for lineno, raw in enumerate(lines):
            obj, error = _parse_line(raw, url, lineno)
            if obj is not None:
                columns.update(obj)
                seen += 1
            first_error = first_error or error
            if seen >= _COLUMN_SAMPLE_OBJECTS or lineno + 1 >= _COLUMN_SAMPLE_LINES:
                break
        if seen or not first_error:
            # a key as JSON writes it, escaped or not: "titel_\u00fc" or "titel_ü"
            keys = {k: {json.dumps(k).encode(), json.dumps(k, ensure_ascii=False).encode()} for k in wanted - columns}
            for lineno, raw in enumerate(lines, lineno + 1):
                if not keys or lineno >= _COLUMN_SEARCH_LINES:
                    break
                if isinstance(raw, bytes) and any(form in raw for forms in keys.values() for form in forms):
                    obj, _ = _parse_line(raw, url, lineno)
                    columns.update(obj or ())
                    keys = {k: v for k, v in keys.items() if k not in columns}
    if not seen and first_error:
        raise InputError(f"not JSON Lines: {first_error}")
    return columns


def count_rows(files: list[str], fmt: str = "auto", storage_options: dict | None = None,
               cancel: threading.Event | None = None) -> int:
    """How many rows read_rows yields from files: Parquet footers' row counts, and the non-blank lines of
    JSONL files counted in one streaming pass (bounded memory, no JSON parsing). Setting ``cancel`` stops
    the count with InterruptedError."""
    total = 0
    for url in files:
        if detect_format(url, fmt) == "parquet":
            total += _parquet_footer(url, storage_options).num_rows
            continue
        with closing(_jsonl_lines(url, storage_options, DEFAULT_MAX_ROW_BYTES)) as lines:
            for lineno, raw in enumerate(lines):
                total += not _is_blank(raw, lineno)
                if cancel is not None and lineno % 4096 == 0 and cancel.is_set():
                    raise InterruptedError("row count cancelled")
    return total
