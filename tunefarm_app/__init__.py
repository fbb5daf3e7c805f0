"""The layer people use, on top of the core (`tunefarm`) and the search (`services`).

The command line, embedded mode (one process, local build and run workers, no Redis or
Postgres), reports, progress views and benchmarks. Nothing below this package imports it.
"""
