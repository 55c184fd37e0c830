"""The command line's own rules, checked without a server: usage errors, ``--help`` and exit codes."""

from __future__ import annotations

import signal

from pgflow.supervisor import exit_code


def test_a_child_killed_by_a_signal_counts_as_a_shell_reports_it() -> None:
    """``supervise`` reports the worst of its children's codes, and a signal death (``-N``) must rank
    above a clean stop: 128 + N, as a shell has it."""
    assert exit_code(-signal.SIGKILL) == 137 and exit_code(-signal.SIGTERM) == 143
    assert [exit_code(code) for code in (0, 1, 2, 3, 130)] == [0, 1, 2, 3, 130]
    assert max(exit_code(code) for code in (0, -signal.SIGKILL, 3)) == 137
