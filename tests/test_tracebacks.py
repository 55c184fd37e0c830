"""A failure's recorded traceback keeps the user's frames whole and folds the worker's own (pgflow's,
anyio's, the event loop's) into one line per run, so the raise a reader looks for is not cut away."""

from __future__ import annotations

import pytest

import pgflow
from pgflow._core.outcomes import folded_traceback

from .helpers import ONE_SERVER

pytestmark = pytest.mark.anyio


def _innermost(n: int) -> None:
    raise ValueError(f"bad input {n}")


def _middle(n: int) -> None:
    _innermost(n)


@ONE_SERVER  # a traceback folded in Python: the same on any server
async def test_a_failed_workflow_s_traceback_shows_the_user_s_frames_and_folds_the_rest(app: pgflow.App) -> None:
    @app.step(name="tb.parse", max_attempts=1)
    def parse(n: int) -> None:
        _middle(n)

    @app.workflow(name="tb.flow")
    async def flow(n: int) -> None:
        await parse(n)

    handle = await flow.start_async(7)
    async with app.worker(concurrency=1):
        with pytest.raises(pgflow.WorkflowFailed) as failed:
            await handle.result_async(timeout=60)
    text = failed.value.traceback
    assert text is not None
    for user_frame in ("in parse", "in _middle", "in _innermost", 'raise ValueError(f"bad input {n}")'):
        assert user_frame in text, (user_frame, text)
    assert "of pgflow, anyio and the event loop]" in text
    assert "/anyio/" not in text and "/pgflow/_core/" not in text and "/asyncio/" not in text, text
    assert text.rstrip().endswith("ValueError: bad input 7")


def test_folding_keeps_chained_exceptions_and_their_user_frames() -> None:
    try:
        try:
            _middle(1)
        except ValueError as exc:
            raise RuntimeError("while parsing") from exc
    except RuntimeError as exc:
        text = folded_traceback(exc)
    assert "ValueError: bad input 1" in text and "RuntimeError: while parsing" in text
    assert "direct cause" in text and text.count("in _innermost") == 1
    assert "frames of pgflow" not in text  # nothing of the worker's here: nothing folded
