"""Streams inside the runtime: the group-committed writer beside the worker, the shared reader."""
