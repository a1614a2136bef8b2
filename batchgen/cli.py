"""The ``batchgen`` command line: ``run`` a job spec, ``validate`` it, ``bench`` the engine."""
from __future__ import annotations

import logging
import signal
import sys
import traceback
from contextlib import contextmanager
from typing import Any, Iterator, NoReturn

import click
import yaml
from tqdm.contrib.logging import logging_redirect_tqdm

from batchgen.bench.command import bench
from batchgen.io import redact
from batchgen.pipeline.errors import JobError, JobInterrupted
from batchgen.pipeline.spec import JobSpec, SpecError, load_spec

log = logging.getLogger("batchgen")

EXIT_FAILED = 1
EXIT_USAGE = 2


@contextmanager
def _logging(verbose: bool, quiet: bool) -> Iterator[None]:
    """batchgen's log records on stderr, printed above the progress bar, for the command's duration."""
    level = logging.DEBUG if verbose else (logging.WARNING if quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    saved = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    try:
        with logging_redirect_tqdm([log]):
            yield
    finally:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {' '.join(redact(message).split())}", err=True)
    sys.exit(code)


def _load(job: str, overrides: tuple[str, ...]) -> JobSpec:
    try:
        return load_spec(job, overrides)
    except SpecError as e:
        for line in e.errors:
            click.echo(f"error: {redact(line)}", err=True)
        sys.exit(EXIT_USAGE)


set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="Override a spec value, e.g. --set sampling.max_tokens=32 (repeatable).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Offline batch generation: prompts from Parquet/JSONL through an LLM into Parquet/JSONL."""


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@set_option
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Only the first N input rows.")
@click.option("--overwrite", is_flag=True, help="Delete earlier output in the output folder and start over.")
@click.option("--force-unlock", is_flag=True,
              help="Take the output folder even if another run holds its lease (only when that run is gone).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, warnings and errors only.")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging and tracebacks.")
def run(job: str, overrides: tuple[str, ...], limit: int | None, overwrite: bool, force_unlock: bool,
        quiet: bool, verbose: bool) -> None:
    """Run the job spec JOB (YAML); rerunning an interrupted job resumes it. One run at a time may write
    an output folder: a second one fails at once, naming the host and pid that holds it."""
    spec = _load(job, overrides)
    from batchgen.pipeline.runner import run_job  # the engine's imports are slow: only when running

    try:
        with _logging(verbose, quiet):
            stats = run_job(spec, limit=limit, overwrite=overwrite, quiet=quiet, force_unlock=force_unlock)
    except SpecError as e:
        for line in e.errors:
            click.echo(f"error: {redact(line)}", err=True)
        sys.exit(EXIT_USAGE)
    except JobInterrupted as e:
        _fail(f"{spec.name}: {e}; rerun the same command to resume", e.exit_code)
    except JobError as e:
        _fail(f"{spec.name}: {e}", EXIT_FAILED)
    except KeyboardInterrupt:  # before the job's own handlers were installed, e.g. while the model loads
        _fail(f"{spec.name}: interrupted before any work was done", 128 + signal.SIGINT)
    except Exception as e:  # noqa: BLE001 - one line unless -v
        if verbose:
            click.echo(redact(traceback.format_exc()), err=True, nl=False)
        _fail(f"{spec.name}: {type(e).__name__}: {e}", EXIT_FAILED)
    click.echo(_summary(stats))


def _summary(stats: dict[str, Any]) -> str:
    return (f"{stats.get('job')}: {stats.get('rows', 0)} rows ({stats.get('ok_rows', 0)} ok, "
            f"{stats.get('error_rows', 0)} errors), {stats.get('prompt_tokens', 0)} prompt + "
            f"{stats.get('completion_tokens', 0)} generated tokens, "
            f"{stats.get('generated_tokens_per_s', 0)} generated tok/s -> "
            f"{(stats.get('spec') or {}).get('output', {}).get('path', '')}")


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@set_option
def validate(job: str, overrides: tuple[str, ...]) -> None:
    """Check the job spec JOB and print it resolved (credentials redacted)."""
    spec = _load(job, overrides)
    click.echo(yaml.safe_dump(spec.resolved(), sort_keys=False, allow_unicode=True), nl=False)


main.add_command(bench)

if __name__ == "__main__":
    main()
