"""What a worker reads back is data from whoever could write the row: arguments over the worker's own
limit fail their workflow, with a clear error, before they are decoded."""

from __future__ import annotations

import pytest

import pgflow

pytestmark = pytest.mark.anyio


async def test_a_worker_refuses_stored_arguments_over_its_limit(dsn: str, schema: str) -> None:
    async def take(text: str) -> int:
        return len(text)

    async with pgflow.App(dsn, schema=schema, max_value_bytes=1 << 20) as roomy, \
            pgflow.App(dsn, schema=schema, max_value_bytes=1024) as strict:
        big = roomy.workflow(name="limits.take")(take)
        strict.workflow(name="limits.take")(take)
        small = await big.start_async("x" * 100)
        large = await big.start_async("x" * 4096)  # within the caller's limit, over the worker's
        async with strict.worker(concurrency=2):
            assert await small.result_async(timeout=60) == 100
            with pytest.raises(pgflow.WorkflowFailed) as failed:
                await large.result_async(timeout=60)
        assert "limit is 1024" in str(failed.value) and "limits.take" in str(failed.value)
