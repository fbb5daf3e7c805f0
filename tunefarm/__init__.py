"""tunefarm: an Ansor-style auto-scheduler for tensor programs.

This package is the core every process shares: workloads, the plain records that cross
process and network boundaries, the record store, targets, errors and process
isolation. It imports nothing from `services` (the search, building, measuring, the
farm) nor from `tunefarm_app` (command line, embedded mode, reports, benchmarks).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`tunefarm.tune_model(...)`: the embedded Python API, imported on first use from the
    layer above (`tunefarm_app.model_tuning`). Importing `tunefarm` or any core module
    never loads that layer or the search."""
    if name in ("tune_model", "tune_models"):
        from tunefarm_app import model_tuning

        return getattr(model_tuning, name)
    raise AttributeError(f"module 'tunefarm' has no attribute {name!r}")
