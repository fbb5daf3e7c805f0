"""Measuring built kernels: on this machine (embedded mode) and on the farm's device agents.

| module | what it holds |
|---|---|
| `runner.py` | `run_kernel` (load, check, time one kernel) and `LocalRunner` (an isolated process) |
| `task_data.py` | the inputs / expected outputs file every kernel of a task runs on |
| `local.py` | embedded mode's `LocalMeasurer` (builds too) |
| `agent.py` | the device agent (`tunefarm agent`): lease, fetch, run, report over gRPC |
| `lease_service.py` | the gRPC server agents dial into (`make_server`, `serve`), its sweeper |
| `settings.py` | the lease service's settings |
| `capabilities.py` | what an agent reports about its machine |
| `kernel_files.py` | where an agent keeps what its sandboxed kernel process reads, under names it makes |

The wire both sides speak (messages, errors, signatures) is `services.protocol`.
Everything here but `local.py` and the server side (`lease_service.py`, `settings.py`) is
what a board runs: no search, build, database or queue code.
"""
