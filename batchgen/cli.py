"""The ``batchgen`` command line: ``run``, ``validate``, ``plan`` a job spec, ``openai-batch`` a request file,
``report`` on or ``show`` the rows of an output, ``bench``, ``cache`` (a prefix KV store)."""
from __future__ import annotations

import json
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
from batchgen.cache_command import cache
from batchgen.io import redact
from batchgen.pipeline.errors import JobError, JobInterrupted
from batchgen.pipeline.interrupt import DEFAULT_GRACE_S
from batchgen.pipeline.spec import JobSpec, SpecError, load_spec, spec_from_dict

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


def _spec_errors(e: SpecError) -> NoReturn:
    for line in e.errors:
        click.echo(f"error: {redact(line)}", err=True)
    sys.exit(EXIT_USAGE)


def _load(job: str, overrides: tuple[str, ...]) -> JobSpec:
    try:
        return load_spec(job, overrides)
    except SpecError as e:
        _spec_errors(e)


set_option = click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
                          help="Override a spec value, e.g. --set sampling.max_tokens=32 (repeatable).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="batchgen", message="batchgen %(version)s")
def main() -> None:
    """Offline batch generation: prompts from Parquet/JSONL through an LLM into Parquet/JSONL."""


limit_option = click.option("--limit", type=click.IntRange(min=1), default=None,
                            help="A trial: only the first N input rows; they are committed, and a later run "
                                 "without --limit adds the rest.")


@contextmanager
def _job_failures(spec: JobSpec, verbose: bool) -> Iterator[None]:
    """Turns a job's failures into one line on stderr and its exit code."""
    try:
        yield
    except SpecError as e:
        _spec_errors(e)
    except JobInterrupted as e:
        _fail(f"{spec.name}: {e}; rerun the same command to resume", e.exit_code)
    except JobError as e:
        _fail(f"{spec.name}: {e}", EXIT_FAILED)
    except KeyboardInterrupt as e:  # before the job's own handlers were installed, e.g. while the model loads
        signum = getattr(e, "signum", signal.SIGINT)  # Terminated: SIGTERM
        _fail(f"{spec.name}: interrupted by {signal.Signals(signum).name} before any work was done", 128 + signum)
    except Exception as e:  # noqa: BLE001 - one line unless -v
        if verbose:
            click.echo(redact(traceback.format_exc()), err=True, nl=False)
        _fail(f"{spec.name}: {type(e).__name__}: {e}", EXIT_FAILED)


def run_options(command):
    """The options of the commands that run a job."""
    for option in reversed((
            set_option, limit_option,
            click.option("--overwrite", is_flag=True,
                         help="Delete earlier output in the output folder and start over."),
            click.option("--force-unlock", is_flag=True,
                         help="Take the output folder even if another run holds its lease (only when that run "
                              "is gone)."),
            click.option("--grace", "grace_s", type=click.FloatRange(min=0), default=DEFAULT_GRACE_S,
                         show_default=True, metavar="SECONDS",
                         help="After a first Ctrl-C (or SIGTERM), how long the requests already running may "
                              "finish before they are aborted; a second one stops at once."),
            click.option("--quiet", "-q", is_flag=True, help="No progress bar, warnings and errors only."),
            click.option("--verbose", "-v", is_flag=True, help="Debug logging and tracebacks."))):
        command = option(command)
    return command


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@run_options
def run(job: str, overrides: tuple[str, ...], limit: int | None, overwrite: bool, force_unlock: bool,
        grace_s: float, quiet: bool, verbose: bool) -> None:
    """Run the job spec JOB (YAML); rerunning an interrupted job resumes it. One run at a time may write
    an output folder: a second one fails at once, naming the host and pid that holds it."""
    _run(_load(job, overrides), limit, overwrite, force_unlock, grace_s, quiet, verbose)


@main.command("openai-batch")
@click.option("--input", "-i", "input_path", required=True,
              help="OpenAI Batch request file (JSONL), local or URL.")
@click.option("--output", "-o", "output_path", required=True, help="Output folder, local or URL.")
@click.option("--model", required=True, help="Built-in name, model folder, .gguf file, or URL.")
@run_options
def openai_batch(input_path: str, output_path: str, model: str, overrides: tuple[str, ...], limit: int | None,
                 overwrite: bool, force_unlock: bool, grace_s: float, quiet: bool, verbose: bool) -> None:
    """Run an OpenAI Batch request file; writes result lines (part-N.jsonl) and error lines (errors-N.jsonl).

    Each line's own settings apply. Prompts may fill the model's context. Lines that leave them out get the API's
    defaults (temperature 1, top_p 1) and at most 4096 tokens; a line without a seed gets its own, from its
    custom_id. --set sampling.KEY=VALUE changes these defaults.
    """
    data = {"name": "openai-batch", "model": {"path": model},
            "input": {"path": input_path, "format": "openai"},
            "sampling": {"temperature": 1.0, "max_tokens": 4096},
            "batching": {"max_prompt_tokens": 1 << 20},  # as the API: prompts up to the model's context
            "output": {"path": output_path, "format": "openai"}}
    try:
        spec = spec_from_dict(data, overrides)
    except SpecError as e:
        _spec_errors(e)
    _run(spec, limit, overwrite, force_unlock, grace_s, quiet, verbose)


def _run(spec: JobSpec, limit: int | None, overwrite: bool, force_unlock: bool, grace_s: float, quiet: bool,
         verbose: bool) -> None:
    from batchgen.pipeline.runner import run_job  # the engine's imports are slow: only when running

    with _job_failures(spec, verbose), _logging(verbose, quiet):
        stats = run_job(spec, limit=limit, overwrite=overwrite, quiet=quiet, force_unlock=force_unlock,
                        grace_s=grace_s)
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
    """Check the job spec JOB, that its model resolves (no weights loaded) and that its input exists with the
    columns it needs; print the spec resolved (credentials redacted). Exit 2 for spec errors, 1 for the rest."""
    from batchgen.pipeline.preflight import check_job

    spec = _load(job, overrides)
    click.echo(yaml.safe_dump(spec.resolved(), sort_keys=False, allow_unicode=True), nl=False)
    found, problems = check_job(spec)
    for line in found:
        click.echo(f"ok: {redact(line)}", err=True)
    for line in problems:
        click.echo(f"error: {' '.join(redact(line).split())}", err=True)
    if problems:
        sys.exit(EXIT_FAILED)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@set_option
@limit_option
@click.option("--completion-tokens", type=click.IntRange(min=1), default=None,
              help="Generated tokens per row to plan for (default: the mean of --rates-from, else "
                   "sampling.max_tokens).")
@click.option("--prefill-tok-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Prompt tokens per second the engine computes (overrides --rates-from).")
@click.option("--decode-tok-s", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Tokens per second in decode-only steps (overrides --rates-from).")
@click.option("--rates-from", metavar="OUTPUT", default=None,
              help="An earlier job's output folder or stats.json: its measured rates, prefix-cache hit rate "
                   "and mean completion length.")
@click.option("--cost-per-hour", type=click.FloatRange(min=0), default=None,
              help="Price of an hour of the machine, to turn the estimated time into a cost.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--verbose", "-v", is_flag=True, help="Debug logging and tracebacks.")
def plan(job: str, overrides: tuple[str, ...], limit: int | None, completion_tokens: int | None,
         prefill_tok_s: float | None, decode_tok_s: float | None, rates_from: str | None,
         cost_per_hour: float | None, as_json: bool, verbose: bool) -> None:
    """Dry-run the job spec JOB: exact row and prompt token counts with the tokenizer alone (no weights),
    rows already committed, expected engine steps and an estimated time."""
    spec = _load(job, overrides)
    from batchgen.pipeline.plan import Rates, format_plan, plan_job, rates_from as read_rates

    with _job_failures(spec, verbose), _logging(verbose, quiet=True):
        rates = read_rates(rates_from, spec.storage_options) if rates_from else Rates()
        rates.prefill_tokens_per_s = prefill_tok_s or rates.prefill_tokens_per_s
        rates.decode_tokens_per_s = decode_tok_s or rates.decode_tokens_per_s
        result = plan_job(spec, limit=limit, rates=rates, completion_tokens=completion_tokens)
    click.echo(json.dumps(result, indent=2) if as_json else format_plan(result, cost_per_hour))


@main.command()
@click.argument("output")
@click.option("-o", "--out", "target", type=click.Path(dir_okay=False), default=None,
              help="The HTML file to write (default: report.html in OUTPUT when it is a local folder, "
                   "else in the current folder).")
@click.option("--verbose", "-v", is_flag=True, help="Tracebacks on failure.")
def report(output: str, target: str | None, verbose: bool) -> None:
    """Write a self-contained HTML report (no network needed to view it) of the job output folder OUTPUT
    (local or s3://; credentials from the AWS environment variables)."""
    from batchgen.report import ReportError, write_report

    try:
        path = write_report(output, target)
    except ReportError as e:
        _fail(str(e), EXIT_FAILED)
    except Exception as e:  # noqa: BLE001 - one line unless -v
        if verbose:
            click.echo(redact(traceback.format_exc()), err=True, nl=False)
        _fail(f"{type(e).__name__}: {e}", EXIT_FAILED)
    click.echo(path)


@main.command()
@click.argument("output")
@click.option("--limit", "-n", type=click.IntRange(min=1), default=20, show_default=True, help="Rows to show.")
@click.option("--errors", is_flag=True, help="Only error rows.")
@click.option("--columns", "-c", default=None, metavar="A,B,...", help="Columns to show, comma-separated.")
@click.option("--width", type=click.IntRange(min=8), default=60, show_default=True,
              help="Characters of a text cell shown; longer ones are cut.")
def show(output: str, limit: int, errors: bool, columns: str | None, width: int) -> None:
    """Print rows of the job output folder OUTPUT (Parquet, JSONL or OpenAI Batch; local or s3://) as a table."""
    from batchgen.report import ReportError
    from batchgen.report.show import ShowOptions, format_table, select_rows

    options = ShowOptions(limit, errors, [c.strip() for c in (columns or "").split(",") if c.strip()], width)
    try:
        click.echo(format_table(select_rows(output, options), width))
    except ReportError as e:
        _fail(str(e), EXIT_FAILED)


main.add_command(bench)
main.add_command(cache)

if __name__ == "__main__":
    main()
