"""``pgflow dashboard``: a web page on the workflows of one App, read from its tables.

Needs the ``web`` extra (Starlette, uvicorn): ``pip install 'pgflow[web]'``. Importing this package
imports neither; ``server.create_app`` and ``server.serve`` do.
"""
