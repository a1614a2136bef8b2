"""Input path expansion, per-URL storage options and filesystems (AWS env, client retries off), redaction."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import split_protocol

from batchgen.io.errors import InputError
from batchgen.io.manifest import STATS, TELEMETRY
from batchgen.io.redaction import redact, remember_secrets_in, remember_url_credentials
from batchgen.io.retry import BOTO_SINGLE_ATTEMPT, retry, single_attempt

__all__ = ["cache_dir", "expand_inputs", "read_bytes", "redact", "storage_options_for", "filesystem", "DATA_SUFFIXES"]

S3_PROTOCOLS = ("s3", "s3a")
_CREDENTIAL_OPTIONS = ("key", "secret", "token", "username", "password", "anon", "profile", "session")
_GLOB_CHARS = "*?["
DATA_SUFFIXES = (".parquet", ".pq", ".jsonl", ".json", ".ndjson")


def cache_dir() -> Path:
    """``$BATCHGEN_CACHE`` or ``~/.cache/batchgen``: fetched models, built kernels, measured rates, file digests."""
    return Path(os.environ.get("BATCHGEN_CACHE") or "~/.cache/batchgen").expanduser()


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def storage_options_for(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for url: the job's options, plus AWS environment settings for S3 and botocore's retries
    turned off (``io.retry`` retries every storage call).

    Explicit options win over the environment; environment credentials are only used when the job
    gives none of its own.
    """
    opts = copy.deepcopy(dict(storage_options or {}))
    protocol, _ = split_protocol(url)
    if protocol in S3_PROTOCOLS:
        env = os.environ
        base: dict[str, Any] = {}
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            base["endpoint_url"] = endpoint
        if not any(k in opts for k in _CREDENTIAL_OPTIONS):
            if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
                base["key"] = env["AWS_ACCESS_KEY_ID"]
                base["secret"] = env["AWS_SECRET_ACCESS_KEY"]
                if env.get("AWS_SESSION_TOKEN"):
                    base["token"] = env["AWS_SESSION_TOKEN"]
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if region:
            base["client_kwargs"] = {"region_name": region}
        opts = _merge(base, opts)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", dict(BOTO_SINGLE_ATTEMPT))
        opts["config_kwargs"] = config
    remember_secrets_in(opts)
    remember_url_credentials(url)
    return opts


def url_problem(url: str) -> str | None:
    """Why ``url`` is no location, or None: a storage scheme without its "//" ("s3:/bucket/key", "s3:bucket"),
    which fsspec would take as a local folder named "s3:"."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):(?!//)", url)
    scheme = m.group(1).lower() if m else ""
    if scheme not in ("", "file", "local", "data") and scheme in fsspec.available_protocols():
        return redact(f"{url!r} is not a URL: {scheme} locations are written {scheme}://...")
    return None


def filesystem(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for url, with storage_options_for applied and the filesystem's own retry
    loop turned down (``io.retry`` retries every storage call)."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, storage_options))
    return single_attempt(fs), path


def read_bytes(url: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The whole (small) file at url; raises InputError when it cannot be read."""
    try:
        fs, path = filesystem(url, storage_options)
        return retry(lambda: fs.cat_file(path), what=f"read {url}")
    except FileNotFoundError:
        raise InputError(redact(f"file not found: {url}")) from None
    except Exception as exc:
        raise InputError(redact(f"cannot read {url}: {type(exc).__name__}: {exc}")) from exc


def _hidden_below(root: str, path: str) -> bool:
    """Whether a folder or file name of path below root starts with '_' or '.'."""
    return any(seg.startswith(("_", ".")) for seg in path[len(root.rstrip("/")):].split("/"))


def _full_url(original: str, fs: fsspec.AbstractFileSystem, path: str) -> str:
    protocol, _ = split_protocol(original)
    if protocol is None and "::" not in original:
        return os.path.abspath(path)  # plain local path in, plain absolute path out
    return fs.unstrip_protocol(path)


def _is_data_file(path: str) -> bool:
    name = path.lower()
    for ext in (".gz", ".bz2", ".xz", ".zst", ".lzma"):
        name = name.removesuffix(ext)
    return name.endswith(DATA_SUFFIXES)


def _expand_one(url: str, storage_options: dict[str, Any] | None) -> list[str]:
    try:
        fs, path = filesystem(url, storage_options)
        if any(c in path for c in _GLOB_CHARS):
            found = retry(lambda: fs.glob(path, detail=True), what=f"glob {url}")
            fixed = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]
            paths = [p for p, info in found.items()
                     if info.get("type") != "directory" and not _hidden_below(fixed, p)]
        elif retry(lambda: fs.isdir(path), what=f"isdir {url}"):
            # a folder stands for the data files under it, as written by OutputWriter (not its stats) or Spark
            found = retry(lambda: fs.find(path), what=f"list {url}")
            paths = [p for p in found if _is_data_file(p) and not _hidden_below(path, p)
                     and p.rsplit("/", 1)[-1] not in (STATS, TELEMETRY)]
        elif retry(lambda: fs.isfile(path), what=f"stat {url}"):
            paths = [path]
        else:
            paths = []
    except InputError:
        raise
    except Exception as exc:
        raise InputError(redact(f"cannot list input {url}: {type(exc).__name__}: {exc}")) from exc
    if not paths:
        raise InputError(redact(f"input path matches no files: {url}"))
    return [_full_url(url, fs, p) for p in paths]


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """fsspec's glob rules as a regex: ``**`` crosses folders, ``*`` and ``?`` do not, ``[...]`` a class."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def would_list(url: str, candidate: str, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether expanding the input ``url`` (a folder or glob) would take the data file ``candidate`` (a URL on
    the same filesystem), by :func:`expand_inputs`' rules; nothing needs to exist."""
    if (split_protocol(url)[0] or "file") != (split_protocol(candidate)[0] or "file"):
        return False
    fs, path = filesystem(url, storage_options)
    target = fs._strip_protocol(candidate)
    if any(c in path for c in _GLOB_CHARS):
        fixed = path[: min(path.index(c) for c in _GLOB_CHARS if c in path)].rsplit("/", 1)[0]
        return bool(_glob_regex(path).fullmatch(target)) and not _hidden_below(fixed, target)
    root = path.rstrip("/")
    return (target.startswith(root + "/") and _is_data_file(target) and not _hidden_below(root, target)
            and retry(lambda: fs.isdir(path), what=f"isdir {url}"))


def expand_inputs(paths: str | list[str], storage_options: dict[str, Any] | None = None) -> list[str]:
    """Expand URLs, globs and folders into a sorted, de-duplicated list of full file URLs.

    Raises InputError naming any path or glob that matches nothing.
    """
    items = [paths] if isinstance(paths, str) else list(paths)
    if not items:
        raise InputError("no input paths given")
    urls: set[str] = set()
    for item in items:
        urls.update(_expand_one(str(item), storage_options))
    return sorted(urls)
