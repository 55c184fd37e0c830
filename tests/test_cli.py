"""The command line's own rules, checked without a server: usage errors, ``--help`` and exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pgflow._supervisor import exit_code

WAIT = 60.0


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "PGFLOW_LOG_LEVEL"}
    return subprocess.run([sys.executable, "-m", "pgflow", *args], env={**environ, "COLUMNS": "200", **env},
                          capture_output=True, text=True, timeout=WAIT)


def test_a_child_killed_by_a_signal_counts_as_a_shell_reports_it() -> None:
    """``supervise`` reports the worst of its children's codes, and a signal death (``-N``) must rank
    above a clean stop: 128 + N, as a shell has it."""
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(-signal.SIGTERM) == 143
    assert [exit_code(code) for code in (0, 1, 2, 3, 130)] == [0, 1, 2, 3, 130]
    assert max(exit_code(code) for code in (0, -signal.SIGKILL, 3)) == 137


@pytest.mark.parametrize("given", ["LOUD", "loud", "verbose", ""])
def test_an_unknown_log_level_is_a_usage_error_not_a_traceback(given: str) -> None:
    result = cli("--log-level", given, "status")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"pgflow: error: argument --log-level: invalid choice: {given.upper()!r} (choose from ")


def test_a_log_level_is_taken_in_any_case_and_a_bad_one_from_the_environment_is_a_usage_error() -> None:
    # A module that cannot be imported: exit 2 with pgflow's own message, past the parsing and the
    # logging set-up, before anything connects.
    for level in ("debug", "Warning", "CRITICAL"):
        result = cli("--log-level", level, "queues", "--app", "no_such_module_here:app")
        assert result.returncode == 2 and "cannot import module 'no_such_module_here'" in result.stderr, \
            result.stderr
    result = cli("queues", "--app", "no_such_module_here:app", PGFLOW_LOG_LEVEL="error")
    assert result.returncode == 2 and "cannot import module" in result.stderr, result.stderr
    result = cli("queues", PGFLOW_LOG_LEVEL="LOUD")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == \
        "pgflow: error: PGFLOW_LOG_LEVEL is one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'LOUD'"


@pytest.mark.parametrize(("command", "shown"), [
    ((), ["--log-level LEVEL", "(default: INFO"]),
    (("worker",), ["(default: 16)", "(default: default)", "(default: 10.0)", "(default: 25.0)", "(default: 1)"]),
    (("workflows", "ls"), ["(default: 50)"]),
    (("workflows", "show"), ["(default: 1000)"]),
    (("worker",), ["--health-port PORT", "(default: 0.0.0.0)"]),
    (("status",), ["(default: 60.0)"]),
    (("tail",), ["(default: 0)"]),
])
def test_help_shows_the_defaults(command: tuple[str, ...], shown: list[str]) -> None:
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for words in shown:
        assert words in text, result.stdout
    assert "(default: None)" not in text and "(default: False)" not in text
