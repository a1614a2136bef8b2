"""The `batchgen cache` commands: what a prefix KV store (``prefix_cache_store``) holds, and pruning it."""
from __future__ import annotations

import contextlib
import json
import sys
from datetime import datetime, timezone
from typing import Iterator

import click

from batchgen.engine.kv_store.admin import NoStore, list_objects, parse_duration, prune, usage
from batchgen.io import redact
from batchgen.io.paths import url_problem


def _when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _duration(ctx, param, value: str | None) -> float | None:
    try:
        return None if value is None else parse_duration(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@contextlib.contextmanager
def _store_errors(url: str) -> Iterator[None]:
    """One redacted error line (exit 1) for a store that is not there or cannot be read, never a traceback."""
    try:
        problem = url_problem(url)
        if problem:
            raise NoStore(problem)
        yield
    except NoStore as e:
        click.echo(f"error: {redact(str(e))}", err=True)
        sys.exit(1)
    except (click.ClickException, click.exceptions.Exit):
        raise
    except Exception as e:  # noqa: BLE001 - any storage or URL failure: say which, briefly
        first = (str(e).strip().splitlines() or [""])[0]
        click.echo(f"error: {redact(f'cannot read the store {url}: {type(e).__name__}: {first}')}", err=True)
        sys.exit(1)


@click.group("cache")
def cache() -> None:
    """Inspect and prune a prefix KV store (a folder or URL; credentials from the AWS environment)."""


@cache.command("ls")
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ls(url: str, as_json: bool) -> None:
    """One line per namespace (model weights, dtype, KV layout, block size): blocks, bytes, oldest, newest."""
    with _store_errors(url):
        per = usage(list_objects(url))
    if as_json:
        click.echo(json.dumps({ns: vars(u) for ns, u in per.items()}, indent=2))
        return
    if not per:
        click.echo(f"{redact(url)}: empty")
    for ns, u in sorted(per.items()):
        click.echo(f"{ns}  {u.objects:>8} blocks  {_size(u.bytes):>10}  {_when(u.oldest)} .. {_when(u.newest)}")


@cache.command("du")
@click.argument("url")
def du(url: str) -> None:
    """Total blocks and bytes in the store."""
    with _store_errors(url):
        per = usage(list_objects(url))
    blocks, size = sum(u.objects for u in per.values()), sum(u.bytes for u in per.values())
    click.echo(f"{_size(size)}\t{blocks} blocks in {len(per)} namespaces\t{redact(url)}")


@cache.command("prune")
@click.argument("url")
@click.option("--max-bytes", type=click.IntRange(min=0), default=None, help="Delete the oldest blocks beyond this.")
@click.option("--older-than", callback=_duration, default=None, help="Delete blocks written longer ago (7d, 12h).")
@click.option("--dry-run", is_flag=True, help="Say what would go; delete nothing.")
def prune_command(url: str, max_bytes: int | None, older_than: float | None, dry_run: bool) -> None:
    """Delete blocks by age and/or down to a size (jobs that needed them recompute them)."""
    if max_bytes is None and older_than is None:
        raise click.UsageError("give --max-bytes and/or --older-than")
    with _store_errors(url):
        r = prune(url, max_bytes=max_bytes, older_than_s=older_than, dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} {r.deleted} blocks ({_size(r.freed_bytes)}); kept {r.kept} ({_size(r.kept_bytes)})")
