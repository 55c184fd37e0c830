"""MkDocs hook: the reference pages that are built from the code, never written by hand.

- ``reference/cli.md`` from ``pgflow.cli``'s argparse parser: every command and subcommand with its help;
- ``reference/settings.md`` from ``pgflow.App``'s signature (defaults) and docstring, and from every
  ``PGFLOW_*`` variable that pgflow's source reads;
- ``reference/errors.md`` from ``pgflow.errors``: every exception class, its bases and docstring, and what
  to do about it.

The descriptions this file adds (a setting the docstring does not describe, an environment variable, what
to do about an error) are checked against the code: a setting, a variable or an error that has none, or
one described here that the code no longer has, fails the build (``make docs`` runs it in strict mode).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import textwrap
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]

# -- settings -------------------------------------------------------------------------------------------

# App parameters the docstring does not describe in a paragraph of their own.
SETTINGS = {
    "dsn": "The server: a libpq URL or key=value string. None: `$PGFLOW_DSN`, else the embedded PostgreSQL 18 "
           "under `.pgflow/` in the project's root (started on first use, or joined).",
    "schema": "The schema that holds every table pgflow makes; several apps can share a database. "
              "None: `$PGFLOW_SCHEMA`, else `pgflow`.",
    "pool_size": "Connections in each event loop's pool (claims, records, stream batches, reads, NOTIFY "
                 "batches). A process holds `pool_size + 2` in steady state (the LISTEN and the maintenance "
                 "connection besides).",
    "notify": "How pings are sent: `buffered` coalesces them, many keys per NOTIFY, at most one NOTIFY "
              "transaction per `notify_interval` under load.",
    "notify_interval": "Seconds between the notifier's NOTIFY transactions under load.",
    "poll_interval": "Seconds between a waiter's looks at the table when no ping comes: the backstop that "
                     "makes a lost ping cost latency, never data.",
    "listen_idle": "Seconds a loop's LISTEN connection stays open with nothing waiting on it.",
    "retention": "Finished workflows older than this are deleted (with their steps, events, messages and "
                 "streams) by a maintenance service on one worker; a number is seconds; None keeps everything.",
    "data_dir": "Where the embedded PostgreSQL keeps its data. None: `$PGFLOW_HOME`, else `.pgflow` in the "
                "project's root (the nearest directory holding `pyproject.toml`, `setup.cfg` or `.git`).",
}

ENVIRONMENT = {
    "PGFLOW_DSN": "The server, when `App(dsn=)` is not given. Unset: the embedded PostgreSQL.",
    "PGFLOW_SCHEMA": "The schema, when `App(schema=)` is not given (default `pgflow`).",
    "PGFLOW_LISTEN_DSN": "`App(listen_dsn=)`: the server itself, when `PGFLOW_DSN` is a transaction-mode "
                         "pooler (the LISTEN and the maintenance locks go there).",
    "PGFLOW_SERVER_ON_THIS_MACHINE": "`App(server_on_this_machine=)`: `1` or `0` (also true/false, yes/no, "
                                     "on/off) when the server does or does not share this machine's cores; unset "
                                     "or `auto`: guessed from the connection's address.",
    "PGFLOW_HOME": "The embedded server's data directory, when `App(data_dir=)` is not given.",
    "PGFLOW_LOG_LEVEL": "The CLI's log level (`--log-level`): DEBUG, INFO (default), WARNING, ERROR or "
                        "CRITICAL.",
    "PGFLOW_LOOP": "`pgflow worker --loop`: `auto` (uvloop where installed; default), `uvloop` or `asyncio`.",
    "PGFLOW_RESTART_DELAY": "`pgflow worker --processes N --restart-delay`: seconds before a child that exited on "
                            "its own is restarted (default 1), doubling with each exit in a row.",
    "PGFLOW_RESTART_DELAY_MAX": "`--restart-delay-max`: the longest that wait grows to (default 10).",
    "PGFLOW_RESTART_RESET": "`--restart-reset`: a child that has lived this many seconds starts its wait over "
                            "(default 30).",
    "PGFLOW_SCHEMA_OWNERS": "Comma-separated roles, besides the migrating one, that may own the schema and "
                            "the objects in it; `migrate` refuses anything owned by another role.",
    "PGFLOW_DASHBOARD_TOKEN": "The dashboard's token (at least 16 characters): asked of every request, and "
                              "needed for `--allow-actions` and any address but 127.0.0.1.",
    "PGFLOW_DASHBOARD_ALLOWED_HOSTS": "Comma-separated host names the dashboard answers to besides loopback "
                                      "and its bound address (`--allowed-host`).",
    "PGFLOW_STREAMS_TOKEN": "`pgflow streams serve`'s token (at least 16 characters; `--token-file` reads it "
                            "from a file): needed for any address but 127.0.0.1.",
    "PGFLOW_STREAMS_ALLOWED_HOSTS": "Comma-separated host names `pgflow streams serve` answers to besides "
                                    "loopback and `--host` (`--allowed-host`).",
    "PGFLOW_TEST_DSN": "The server the pytest plugin's schemas are made on; unset: the project's embedded "
                       "PostgreSQL.",
}

# -- errors ---------------------------------------------------------------------------------------------

WHAT_TO_DO = {
    "PgflowError": "Catch it to catch every error pgflow raises on purpose.",
    "ConfigurationError": "Read its one line: it says what to check (the DSN, a role, a schema owned by "
                          "another role, a bad option). The CLI exits 2 with it. Fix the configuration; "
                          "retrying does not help.",
    "SerializationError": "A value does not encode, is too big (`max_value_bytes`, 8 MiB) or does not fit "
                          "the type hint: the message names the argument. Nothing was written; fix the value "
                          "or the hint.",
    "WorkflowConflict": "The id you chose is taken by a workflow of another name: choose another id.",
    "UnknownWorkflow": "Check the id (`pgflow workflows ls`), or import the module that registers the "
                       "workflow in this process.",
    "NonDeterministicWorkflow": "The code now makes different durable calls than the journal recorded. Put "
                                "the change behind `pgflow.patched()`, and run `pgflow check-replay` before "
                                "a deploy (see [Changing workflow code](../guides/changing-code.md)).",
    "CannotResume": "Only failed or cancelled workflows resume; a running one is still going.",
    "WorkflowFailed": "Raised by `result()`: read `error_type`, `message` and `traceback` (or `pgflow "
                      "workflows show ID`), fix the cause, then `handle.resume()` reruns from the failed step.",
    "WorkflowCancelled": "Raised by `result()`: somebody cancelled it, or it expired unrun (`reason` says "
                         "so). `resume()` runs it again if you still want it.",
    "WorkflowExpired": "The recorded reason of an unrun workflow past its `expires=`: start it again with a "
                       "later expiry if it is still useful.",
    "StepFailed": "A replay met a step error whose type is not importable in this worker: import the "
                  "module that defines it in the worker (`pgflow worker` imports your app's module).",
    "WorkflowTimeout": "The workflow ran past its `timeout=`: raise the timeout, or make the work "
                       "shorter; `resume()` runs it again.",
    "StepTimeout": "A step attempt ran past `@app.step(timeout=)`; it is retried under the step's policy "
                   "(`retry_on` decides). Keep blocking calls in `def` steps.",
    "MaxAttemptsExceeded": "The workflow's runs were cut short too often (`max_attempts`, default 20; a "
                           "workflow that kills its worker while it runs alone, after min(max_attempts, 3) "
                           "crashes): something kills its worker (a segfault, the OOM killer, `os._exit`). Read "
                           "the error and the worker's log, fix it, then `resume()`.",
    "EmbeddedUnavailable": "No DSN and no embedded PostgreSQL on this platform: set `PGFLOW_DSN` (or pass "
                           "`dsn=`) to a server of your own.",
    "ExecutionInterrupted": "Internal: stops an execution that must not go on writing. A `BaseException`, "
                            "so `except Exception` in your code does not swallow it; never catch it.",
    "LeaseLost": "Internal: another worker took this workflow over; this execution stops writing.",
    "StoreUnavailable": "Internal: the database could not record progress for too long; the run stops and "
                        "is resumed later.",
    "CancelRequested": "Internal: the workflow was cancelled while it ran.",
    "Suspended": "Internal: a long sleep or wait gives the worker slot back; the workflow is due again "
                 "when it ends.",
}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _docstring_paragraphs(doc: str) -> dict[str, str]:
    """``name`` -> the docstring paragraph that begins by naming it."""
    found: dict[str, str] = {}
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        match = re.match(r"``(\w+)(?:=None)?``", paragraph.strip())
        if match:
            text = re.sub(r"``([^`]+)``", r"`\1`", paragraph.strip())
            found[match.group(1)] = text
    return found


def settings_page() -> str:
    import pgflow

    signature = inspect.signature(pgflow.App.__init__)
    described = _docstring_paragraphs(pgflow.App.__doc__ or "")
    names = [name for name in signature.parameters if name != "self"]
    missing = [n for n in names if n not in described and n not in SETTINGS]
    stale = [n for n in SETTINGS if n not in names]
    rows = []
    for name in names:
        parameter = signature.parameters[name]
        default = "required" if parameter.default is inspect.Parameter.empty else repr(parameter.default)
        rows.append(f"| `{name}` | `{_cell(default)}` | {_cell(SETTINGS.get(name) or described[name])} |")
    variables = sorted(set(re.findall(r"\bPGFLOW_[A-Z_]*[A-Z]\b", "\n".join(
        path.read_text(encoding="utf-8") for path in (ROOT / "pgflow").rglob("*.py")))))
    missing += [v for v in variables if v not in ENVIRONMENT]
    stale += [v for v in ENVIRONMENT if v not in variables]
    if missing or stale:
        raise PluginError(f"docs/_hooks/reference.py: settings without a description: {missing}; described but"
                          f" gone from the code: {stale}")
    env_rows = [f"| `{name}` | {_cell(ENVIRONMENT[name])} |" for name in variables]
    return "\n".join([
        "# Settings and environment variables",
        "",
        "Generated by `make docs` from `pgflow.App`'s signature and docstring, and from every `PGFLOW_*`",
        "variable pgflow's source reads. An argument given to `App()` wins over its environment variable.",
        "",
        "## `pgflow.App(...)`",
        "",
        "| setting | default | what it does |",
        "|---|---|---|",
        *rows,
        "",
        "## Environment variables",
        "",
        "| variable | what it sets |",
        "|---|---|",
        *env_rows,
        "",
        "Per-worker settings (`concurrency`, `queues`, `lease`, `grace`, `health_port`) are arguments of",
        "`app.worker()` and flags of [`pgflow worker`](cli.md#pgflow-worker); queue limits are",
        "`app.queue(name, concurrency=, rate_limit=, per=)`.",
        "",
    ])


# -- CLI ------------------------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def cli_page() -> str:
    from pgflow import cli

    os.environ["COLUMNS"] = "110"  # argparse wraps help to the terminal's width: the same page everywhere
    parser = cli._parser()
    lines = [
        "# Command line",
        "",
        "Generated by `make docs` from `pgflow.cli`'s parser: what `pgflow <command> --help` prints.",
        "Every command takes `--app MODULE:APP` (else `PGFLOW_DSN` / `PGFLOW_SCHEMA`, else the embedded",
        "server). Exit codes: 0 success; 1 a verdict (`status` unhealthy, `check-replay` found a workflow that",
        "would not replay, a failed operation); 2 a usage or configuration error (for `check-replay`: any",
        "failure to check); `pgflow worker` 3 when its grace period ran out and work was handed back, 130 when a",
        "second signal cut the drain short; 141 when the reader of its output went away.",
        "",
        "## pgflow",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]

    def walk(prefix: str, parser: argparse.ArgumentParser, depth: int) -> None:
        for name, help_text, sub in _subcommands(parser):
            full = f"{prefix} {name}"
            lines.extend([f"{'#' * min(depth, 4)} {full}", ""])
            if help_text:
                lines.extend([help_text[0].upper() + help_text[1:] + ".", ""])
            lines.extend(["```text", sub.format_help().rstrip(), "```", ""])
            walk(full, sub, depth + 1)

    walk("pgflow", parser, 2)
    return "\n".join(lines)


# -- errors ---------------------------------------------------------------------------------------------


def errors_page() -> str:
    from pgflow import errors

    classes = [value for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, BaseException) and not name.startswith("_")
               and value.__module__ == errors.__name__]
    missing = [c.__name__ for c in classes if c.__name__ not in WHAT_TO_DO]
    stale = [n for n in WHAT_TO_DO if n not in {c.__name__ for c in classes}]
    if missing or stale:
        raise PluginError(f"docs/_hooks/reference.py: errors without what to do: {missing}; described but gone"
                          f" from pgflow/errors.py: {stale}")
    public = [c for c in classes if issubclass(c, Exception)]
    internal = [c for c in classes if not issubclass(c, Exception)]
    lines = [
        "# Errors",
        "",
        "Generated by `make docs` from `pgflow/errors.py`. Every public one is importable from `pgflow`",
        "(`pgflow.WorkflowFailed`, ...) and derives from `pgflow.PgflowError`; some also derive from the",
        "built-in they resemble (`SerializationError` is a `TypeError`, the timeouts are `TimeoutError`s),",
        "so existing `except` clauses keep working.",
        "",
    ]

    def entry(cls: type[BaseException]) -> None:
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        doc = re.sub(r"``([^`]+)``", r"`\1`", inspect.cleandoc(cls.__doc__ or ""))
        lines.extend([f"### {cls.__name__}", "", f"Bases: {bases}", "", textwrap.dedent(doc), "",
                      f"**What to do:** {WHAT_TO_DO[cls.__name__]}", ""])

    lines.extend(["## Raised to you", ""])
    for cls in public:
        entry(cls)
    lines.extend(["## Internal: they stop an execution", "",
                  "These derive from `BaseException`, not `Exception`, so that a workflow's own",
                  "`except Exception:` cannot swallow them and carry on writing. You meet them only in a",
                  "traceback; never catch them.", ""])
    for cls in internal:
        entry(cls)
    return "\n".join(lines)


# -- the hook -------------------------------------------------------------------------------------------

PAGES = {"reference/cli.md": cli_page, "reference/settings.md": settings_page, "reference/errors.md": errors_page}


def on_files(files: Files, config: Any) -> Files:
    for path, build in PAGES.items():
        files.append(File.generated(config, path, content=build()))
    return files
