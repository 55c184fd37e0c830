"""pgflow's benchmarks: ``python -m benchmarks NAME`` (see benchmarks/README.md)."""
