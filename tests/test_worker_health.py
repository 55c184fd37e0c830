"""``pgflow worker --health-port``: one worker's liveness probe, served by real worker processes,
answering 200 while the worker works and 503 once its loop, heartbeat or listener has failed for longer
than its lease; a queued workflow nobody serves (its name or its queue) does not make it unhealthy:
that is ``pgflow status``'s business, the fleet's (see pgflow/_core/health.py)."""

from __future__ import annotations

import http.client
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import psycopg
import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import LEASE, Proc, Processes, wait_until
from .proxy import Proxy

WAIT = 60.0


def probe(port: int, path: str = "/healthz", method: str = "GET") -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def probe_port(worker: Proc, procs: Processes) -> int:
    found = wait_until(lambda: re.search(r"answers its liveness probe on http://[^:]+:(\d+)/healthz", worker.output()),
                       "the worker to serve its probe", procs, worker)
    return int(found[1])


def healthy(port: int) -> bool:
    return probe(port)[0] == 200


@ONE_SERVER  # the probe's HTTP answers, the server cut off by a proxy: the same on any server
def test_the_probe_says_ok_ignores_unserved_names_refuses_junk_and_fails_without_the_database(
        procs: Processes, dsn: str, schema: str, worker_env: dict[str, str]) -> None:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    proxy = Proxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    gone = False
    try:
        env = {**worker_env, "PGFLOW_DSN": proxy.dsn(dsn)}
        worker = procs.worker("w", "tests.apps.probed:app", env, lease=LEASE, extra=["--health-port", "0"])
        port = probe_port(worker, procs)
        wait_until(lambda: healthy(port), "the probe to say ok", procs, worker)
        assert probe(port) == (200, "ok\n")
        assert probe(port, method="HEAD")[0] == 200
        assert probe(port, "/fleetz") == (200, "ok\n")  # the fleet's verdict: nothing waits yet

        # One queued workflow whose name no live worker serves: the fleet is unhealthy (pgflow status),
        # this worker is not. (Once the worker has warned of the name, it has seen it.)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs)'
                         " VALUES ('orphan', 'nobody.runs.this', 'default', '\\x80')")
        wait_until(lambda: "named 'nobody.runs.this', which no live worker runs" in worker.output(),
                   "the worker to see the unserved name", procs, worker)
        # And a workflow this worker runs, on a queue no live worker serves: the same.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f'INSERT INTO "{schema}".workflows (id, name, queue, inputs)'
                         " VALUES ('elsewhere', 'probed.noop', 'elsewhere', '\\x80')")
        status = subprocess.run([sys.executable, "-m", "pgflow", "status"], env=worker_env, capture_output=True,
                                text=True, timeout=WAIT)
        assert status.returncode == 1 and "nobody.runs.this" in status.stdout
        assert "1 workflows waiting on queue 'elsewhere': no live worker serves that queue" in status.stdout
        assert probe(port) == (200, "ok\n")
        # The fleet's verdict from the worker's port says what pgflow status says, naming nothing
        # (it is read anew at most every FLEET_EVERY seconds: the ok above may be kept that long).
        fleet = wait_until(lambda: (reply := probe(port, "/fleetz"))[0] == 503 and reply,
                           "/fleetz to report the fleet's problems", procs, worker)
        assert fleet[1] == "unhealthy: 2 fleet problems (pgflow status names them)\n"

        # Anyone may reach the port: only GET/HEAD /healthz is answered, junk gets an HTTP error, and
        # clients that send nothing do not hold the probe up.
        assert probe(port, "/")[0] == 404 and probe(port, "/healthz/../x")[0] == 404
        assert probe(port, method="POST")[0] == 501
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        try:
            assert probe(port) == (200, "ok\n")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as junk:
                junk.sendall(b"\x00\xff\xfe garbage\r\n\r\n")
                assert junk.recv(100).startswith(b"HTTP/1.0 400")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as huge:
                huge.sendall(b"GET /" + b"a" * 70_000 + b" HTTP/1.0\r\n\r\n")
                assert huge.recv(100).startswith(b"HTTP/1.0 414")
        finally:
            for sock in idle:
                sock.close()
        assert worker.alive()

        # The database goes away (every link cut, no new one accepted): the heartbeat and the listener
        # fail, and past the lease the probe says so. The process itself runs on.
        proxy.close()
        gone = True
        # (The listener's loss may be reported a moment before the heartbeat's: each is judged from
        # when it was last seen well, and a renewal can land after the listener was seen down.)
        answer = wait_until(lambda: ((reply := probe(port))[0] == 503
                                     and "the heartbeat has not been renewed for" in reply[1] and reply),
                            "the probe to fail for the heartbeat", procs, worker)
        assert answer[1].startswith("unhealthy: ")
        assert "postgres" not in answer[1].lower() and "127.0.0.1" not in answer[1]
        assert worker.alive()
    finally:
        if not gone:
            proxy.close()


@ONE_SERVER  # the probe's HTTP answers and the process's loop: the same on any server
def test_the_probe_reports_a_blocked_loop_and_recovers(procs: Processes, dsn: str, schema: str,
                                                      worker_env: dict[str, str]) -> None:
    worker = procs.worker("w", "tests.apps.probed:app", worker_env, lease=LEASE, extra=["--health-port", "0"])
    port = probe_port(worker, procs)
    wait_until(lambda: healthy(port), "the probe to say ok", procs, worker)
    with pgflow.App(dsn, schema=schema) as caller:
        blocking = caller.start_by_name("probed.block", 4 * LEASE)  # blocks the worker's loop for 8 s
        status, text = wait_until(lambda: (reply := probe(port))[0] == 503 and reply, "the probe to fail", procs,
                                  worker)
        assert "the worker's event loop has not run for" in text
        # Answered by the probe's own thread while the loop is stuck, not timed out.
        began = time.monotonic()
        assert probe(port)[0] == 503 and time.monotonic() - began < 2.0
        assert blocking.result(timeout=WAIT) is None
        wait_until(lambda: healthy(port), "the probe to recover", procs, worker)
        assert caller.start_by_name("probed.noop").result(timeout=WAIT) == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit() == 0
    with pytest.raises(OSError):  # it stopped with its worker
        probe(port)


@ONE_SERVER  # the probe's HTTP answers: the same on any server
async def test_an_in_process_worker_owns_its_probe(app: pgflow.App) -> None:
    @app.workflow(name="probed.here")
    async def here() -> int:
        return 2

    async with app.worker(health_port=0, health_host="127.0.0.1") as worker:
        assert worker.health is not None
        port = worker.health.port
        with anyio.fail_after(WAIT):
            while (await anyio.to_thread.run_sync(probe, port))[0] != 200:
                await anyio.sleep(0.1)  # the listener connects beside the worker's start
            assert await (await here.start_async()).result_async() == 2
        # A second worker cannot take the same port: a clear error, before it registers.
        with pytest.raises(pgflow.ConfigurationError, match=f"cannot serve the health probe on 127.0.0.1:{port}"):
            async with app.worker(health_port=port, health_host="127.0.0.1"):
                pass
        assert (await app.workers_info_async())[0].id == worker.id and len(await app.workers_info_async()) == 1
    with pytest.raises(OSError):
        probe(port)
    for bad in (-1, 65536, True, "80"):
        with pytest.raises(pgflow.ConfigurationError, match="health_port is a TCP port"):
            app.worker(health_port=bad)  # type: ignore[arg-type]


pytestmark = pytest.mark.anyio


@ONE_SERVER  # an option refused before anything connects: the same on any server
def test_health_port_is_refused_with_several_processes(worker_env: dict[str, str]) -> None:
    for args, words in ((["--processes", "2", "--health-port", "8081"], "--health-port probes one worker process"),
                        (["--health-port", "70000"], "--health-port is a TCP port")):
        result = subprocess.run([sys.executable, "-m", "pgflow", "worker", "tests.apps.probed:app", *args],
                                env=worker_env, capture_output=True, text=True, timeout=WAIT)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert words in result.stderr.splitlines()[-1]


def test_the_kubernetes_manifest_probes_the_port_the_worker_serves() -> None:
    manifest = (Path(__file__).resolve().parent.parent / "workers" / "kubernetes.yaml").read_text()
    served = re.search(r'"--health-port", "(\d+)"', manifest)
    assert served is not None
    assert f"- {{name: health, containerPort: {served[1]}}}" in manifest
    probe_spec = manifest[manifest.index("livenessProbe:"):]
    assert "httpGet: {path: /healthz, port: health}" in probe_spec
    assert "pgflow status" not in probe_spec  # the fleet's health is no pod's liveness
