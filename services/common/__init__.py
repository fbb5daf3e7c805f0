"""What the farm's server-side processes (API, scheduler, build workers, lease service) share.

| module | what it holds |
|---|---|
| `artifacts.py` | the artifact root's directory layout, and reading and writing files under it |
| `queues.py` | the names of the build queues and jobs (the scheduler enqueues, the workers work) |
| `settings.py` | `ServiceSettings`: the settings each process's own inherit (database, artifact root, Redis, queue prefix) |
"""
