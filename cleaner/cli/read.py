"""The commands that read a warehouse or run the sandbox: report, sandbox run, sql, compact, show, ui.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import (
    DEFAULT_WAREHOUSE,
    WarehouseOpt,
    app,
    build_config,
    call_job,
    console,
    err_console,
    fail,
    sandbox_app,
)
from cleaner.cli.options import Flags, config_flags
from cleaner.report.inspection import Panels


class OutputFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


@app.command()
def report(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    out: Annotated[Path | None, typer.Option("--out", help="Directory for the PNGs and report.md (default: <warehouse>-report/ beside the warehouse).", show_default=False)] = None,
) -> None:
    """Plot a warehouse: accuracy, tool failures, merges, the premise diagnostic, train metrics,
    error types, ablation grids and eval results as PNGs, and report.md embedding them.

    Figures whose data the warehouse lacks are skipped, and report.md says why.
    """
    from cleaner.report.job import default_report_dir, report_job
    from cleaner.warehouse import Warehouse

    out = out or default_report_dir(warehouse)
    written = call_job(report_job, Warehouse(warehouse), out)
    for line in written.findings:  # a display shows what is stored, and says what the readers' gate finds
        err_console.print(f"warning: {line}", soft_wrap=True, highlight=False, markup=False)
    for section in written.sections:
        status = section.file or f"skipped: {section.skipped}"
        console.print(f"{section.title}: {status}", soft_wrap=True, highlight=False)
    console.print(f"report: {written.page}")


@sandbox_app.command("run")
def sandbox_run(
    file: Annotated[Path, typer.Argument(help="Python file to run.")],
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Wall-clock limit in seconds.")] = 4.0,
    stdin: Annotated[Path | None, typer.Option("--stdin", help="File fed to the code's stdin.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run one Python file through the sandbox and print the result.

    Exits 0 whenever the sandbox worked, whatever the code did; non-zero if FILE is missing or the
    sandbox itself failed.
    """
    import dataclasses

    from rich.table import Table

    from cleaner.sandbox import ExecStatus, SandboxConfig, SandboxError, make_sandbox
    from cleaner.tools.responses import format_tool_response

    for path in (file, stdin):
        if path is not None and not path.is_file():
            raise fail(f"no such file: {path}")
    try:
        config = SandboxConfig(workers=1, timeout_s=timeout_s)
        with make_sandbox(config) as sandbox:
            result = sandbox.run(file.read_text(), stdin.read_text() if stdin else None)
    except (SandboxError, ValueError) as error:
        raise fail(f"sandbox failed: {error}") from error
    if result.status == ExecStatus.INFRA_ERROR:
        raise fail(f"sandbox failed: {result.stderr}")
    if as_json:
        ok = result.status == ExecStatus.OK
        reason = None if ok else str(result.status)
        response = format_tool_response(ok, result.stdout, result.stderr, reason)
        # with the text a model would see, which the sandbox itself does not word
        typer.echo(json.dumps({**dataclasses.asdict(result), "response": response}))
        return
    table = Table(show_header=False, title=str(file))
    for name in ("status", "error_type", "stdout", "stderr", "exec_ms"):
        value = getattr(result, name)
        table.add_row(name, f"{value:.1f}" if name == "exec_ms" else str(value), end_section=True)
    console.print(table)


# ---------------------------------------------------------------------------------------------
# Warehouse commands


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="DuckDB SQL over the views: rollouts, segments, attempts, ...")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    output_format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file (outside the warehouse), whole or not at all.")] = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Re-read every part and compare its CRC-32 with the manifest's: sees bytes changed "
                         "beneath the file system, at the cost of reading the whole warehouse.")] = False,
    allow_write: Annotated[Path | None, typer.Option(
        "--allow-write", metavar="DIR", show_default=False,
        help="Run any statement (COPY ... TO, ATTACH, CREATE, ...), reading and writing files under DIR only, "
             "which must lie outside the warehouse; without it only SELECT statements run.")] = None,
) -> None:
    """Run DuckDB SQL over the warehouse views, read-only: SELECT statements (WITH, FROM, DESCRIBE,
    SHOW, SUMMARIZE), on a connection that reads files under the warehouse only. Ctrl-C stops a
    query.

    Views: rollouts, segments, purified, purify_configs, iterations, train_steps, eval_rollouts,
    eval_segments, eval_runs, and the convenience views attempts (assistant segments with the outcome
    of their call) and failures.
    """
    from cleaner.report.query import SqlRequest, sql_job
    from cleaner.warehouse import Warehouse

    request = SqlRequest(query, output_format.value, output, allow_write, verify)
    result = call_job(sql_job, Warehouse(warehouse), request)
    if isinstance(result, str):
        typer.echo(result, nl=False)
    elif result is not None:
        console.print(result)


@app.command()
def compact(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    dataset: Annotated[str | None, typer.Option(help="One dataset (default: all); segments go with rollouts.")] = None,
    iteration: Annotated[int | None, typer.Option(help="One iteration (default: all).")] = None,
    target_mb: Annotated[float, typer.Option(help="Parts below this size are merged into parts of at most this size.")] = 128.0,
) -> None:
    """Merge each partition's small parts into few, atomically.

    Safe to interrupt: readers see every row once at any moment, and the next compaction finishes
    what an interrupted one left. Writers may keep adding parts meanwhile; a reader that listed the
    parts just before they were merged may have to read again.
    """
    from rich.table import Table

    from cleaner.warehouse.compact import compact as compact_warehouse

    result = call_job(compact_warehouse, warehouse, dataset, iteration, int(target_mb * 2**20))
    table = Table("dataset", "partition", "parts", "rows", "MB before", "MB after")
    for merge in result.merges:
        table.add_row(merge.dataset, merge.partition, str(merge.n_parts), str(merge.n_rows),
                      f"{merge.bytes_before / 2**20:.2f}", f"{merge.bytes_after / 2**20:.2f}")
    if result.merges:
        console.print(table)
    if result.n_leftovers:
        console.print(f"removed {result.n_leftovers} files left by an interrupted compaction")
    merged = sum(merge.n_parts for merge in result.merges)
    console.print(f"merged {merged} parts into {len(result.merges)} in {warehouse}")


@app.command()
@config_flags("show")
def show(
    rollout_id: Annotated[str, typer.Argument(help="The rollout to print.")],
    *,
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    flags: Flags,
    view: Annotated[Panels, typer.Option("--view", help="raw | purified | both.")] = Panels.BOTH,
    tokenizer: Annotated[bool, typer.Option(help="Decode with the collecting policy's tokenizer.")] = True,
) -> None:
    """Print one rollout raw (failures red, retries yellow, what SAAR drops struck through) and purified.

    With --edit mask the second view is the raw sequence with what replace would drop marked as
    masked (kept in context, not trained).

    The purified view marks each step's outcome (clean, shallow, deep, mixed, unrecovered, answered),
    each merge's similarity, the row's stats, and this rollout's advantage under every stored config.
    """
    from cleaner.engine.saar.walk import RenderSettings
    from cleaner.report.inspection import Decoder, load_decoder, load_inspection
    from cleaner.report.show import show_rollout
    from cleaner.warehouse import Warehouse, WarehouseError
    from cleaner.warehouse.gate import collected_iteration, findings_of, first_line

    saar = flags.build(RenderSettings, purified=True)
    try:
        store = Warehouse(warehouse)
        connection = store.connect(warn_foreign=False)  # one connection for every read; the gate names them
        inspection = load_inspection(store, rollout_id, connection)
        iteration = collected_iteration(connection, rollout_id) if inspection is None else (
            None if inspection.eval_id is not None else inspection.iteration)
        state = first_line(findings_of(store, iteration), store.root) if iteration is not None else None
    except WarehouseError as exc:
        raise fail(str(exc)) from exc
    if inspection is None:
        raise fail(state or f"no rollout {rollout_id!r} in {warehouse}")
    if state is not None:  # a display shows what is stored, and says what the readers' gate finds
        err_console.print(f"warning: {state}", soft_wrap=True, highlight=False, markup=False)
    decoder = load_decoder(inspection.model) if tokenizer and view is not Panels.RAW else Decoder(
        None, "--no-tokenizer: text below is the stored segment text, not decoded tokens")
    console.print(show_rollout(inspection, saar, decoder, view))




@app.command()
def ui(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    host: Annotated[str, typer.Option(help="Address to listen on; anything but loopback needs --token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0: any free one).")] = 8765,
    token: Annotated[str | None, typer.Option(help="Every request must carry it (?token= once, then a cookie).", envvar="CLEANER_UI_TOKEN", show_default=False)] = None,
) -> None:
    """Browse a warehouse in a web browser, read-only: overview charts, a filterable rollout list,
    each rollout raw beside its purified rows with every merge decision, and a SQL box.

    Serves until interrupted (Ctrl-C); writes nothing into the warehouse. Needs the `ui` extra.
    """
    try:
        import jinja2  # noqa: F401  (the ui extra: checked before anything starts)
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise fail(f"cleaner ui needs the ui extra ({error.name} is missing): pip install 'cleaner[ui]'") from error
    from cleaner.ui.server import UiConfig, serve

    config = build_config(UiConfig, warehouse=warehouse, host=host, port=port, token=token)
    call_job(serve, config, started=lambda url: console.print(f"serving {warehouse} read-only at {url}", soft_wrap=True))
