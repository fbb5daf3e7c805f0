"""tunefarm: an Ansor-style auto-scheduler for tensor programs.

This package is the core every process shares: workloads, the plain records that cross
process and network boundaries, the record store, targets, errors and process
isolation; the search engine (`search/`), the measuring library (`measure/`), models
(`models/`) and embedded mode (`tune.py`). It imports nothing from `services` (the farm)
nor from `tunefarm_app` (command line, reports, benchmarks).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`tunefarm.tune_model(...)`: the embedded Python API (`tunefarm.tune`), imported on
    first use: importing `tunefarm` does not load TVM or the search."""
    if name in ("tune_model", "tune_models"):
        from tunefarm import tune

        return getattr(tune, name)
    raise AttributeError(f"module 'tunefarm' has no attribute {name!r}")
