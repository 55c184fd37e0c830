"""One module per system of the tasks benchmark: the code its worker process imports (module-level apps
configured from BENCH_DSN / BENCH_CONCURRENCY) and the client calls (``setup``, ``enqueue``, ``latency``)
run by ``python -m benchmarks.client``. The orchestrator never imports these modules: each system's
libraries load only in its own processes."""
