"""The engine's conformance suite: every port's contract, stated as tests a second engine must pass.

pgflow's orchestration records everything through the ports of ``pgflow._core.engine.Engine``
(``engine.starts``, ``.claims``, ``.journal``, ``.chunks``, ``.ends``, ``.waits``, ``.reruns``,
``.workers``, ``.workflows``, ``.pausing``, ``.debounces``, ``.key_limits``, ``.details``, ``.management``,
``.migrations``, ``.channel``). Each module here is a port (``test_<port>.py``; ``test_schema.py``:
migrations and the signal keyring; ``test_details.py``: details and management's resume): a test
class's docstring says in plain words what any engine must do, and each test states one rule of it, in
a form a wrong engine fails. The tests speak only through the ports (and the other ports' answers),
never through the tables, and in the ports' own types (``Claimed``, ``Fence``, ``StepRecord``, ...), so
the same tests judge an engine that has no tables: an in-memory one for fast unit tests, or a sharded
one. (River's ``riverdrivertest`` is the model.) A rule today's engine breaks is written as it should
hold and marked ``xfail(strict=True)`` with the reason.

Running it::

    .venv/bin/python -m pytest -q tests/engine -k pg18      # the embedded PostgreSQL 18
    .venv/bin/python -m pytest -q tests/engine -k pg15      # the PostgreSQL 15 at 127.0.0.1:5432

``make test`` runs it on both servers, with the rest of the suite.

Against a new engine: write a factory (``tests/engine/conftest.py``'s ``EngineFactory``: ``store()``
opens a fresh, empty store and yields its engine, ``peer(engine)`` is another process's
engine on the same store, ``listening(channels)`` hears the pings that ride on the engine's commits)
and add it to ``ENGINES`` there; every test then runs against it too. Each factory is still run once
per server of the suite's parametrization (``server``: pg18, pg15); one that needs no server can
``pytest.skip`` on pg15 so it runs once. The tests share one store per engine and server (a store
costs a migration) and keep apart by unique workflow names, queues, ids and worker ids
(``kit.unique``), so an engine must keep those apart as PostgreSQL does; none moves the store's clock,
and none counts on a store empty but of its own work.

Leases are short (tenths of a second) where a rule is about a lease running out, and the tests then
wait for it in real time: an engine measures leases on a clock of its own, not one a test can move.
"""
