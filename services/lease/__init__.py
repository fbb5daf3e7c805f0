"""The lease service (`tunefarm lease-service`, `python -m services.lease`): the gRPC
server the device agents dial into (`AgentService` of proto/tunefarm/v1/measurer.proto).

| module | what it holds |
|---|---|
| `servicer.py` | `AgentServicer`: the RPCs (register, heartbeat, health, lease, model runs), and the status codes of errors |
| `auth.py` | who may call, and as which agent: bearer tokens, agent secrets, the lease an agent holds |
| `work_board.py` | which device classes have work, read once for every waiting long poll |
| `files.py` | what `Fetch` serves, from under the artifact root |
| `results.py` | a `ReportResults` stream: what it may store, and storing it in groups |
| `sweeper.py` | the thread that expires leases, marks silent agents offline, gives up batches |
| `server.py` | `make_server(settings)` (built, not started), `serve()`, TLS credentials |
| `settings.py` | `LeaseServiceSettings`, the only reader of its environment |
| `cli.py`, `__main__.py` | the command line |

All state is in PostgreSQL, so the service can restart (or run as several replicas) at
any time. What it refuses, and why, is in the docstrings of `auth.py` (who may act as an
agent), `results.py` (results the lease was not handed) and `servicer.py` (device
classes, signatures, error messages).
"""
