"""The farm's PostgreSQL schema and the small operations every farm process shares.

| module | what it holds |
|---|---|
| `settings.py` | `DatabaseSettings` (TUNEFARM_DATABASE_URL, pool sizes) |
| `models/` | the tables (SQLAlchemy 2 ORM) and their invariants, by resource: accounts, devices, tuning, farm work |
| `states.py` | the states of their rows (tokens, agents, jobs, batches, leases, confirmations, model runs) |
| `session.py` | engine and session factory, `transaction()` (commit, rollback, typed errors) |
| `exceptions.py` | `DatabaseError` and its subclasses |
| `migrate.py` | Alembic from the package: `upgrade`, `check_schema`, `create_database`, ... |
| `statements.py` | the database clock (`db_now`) and locked row reads |
| `tokens.py` | team and agent tokens: issue, verify, revoke; the operator's: register, list, find, agent names |
| `batches.py` | the batch state machine (`transition_batch`), a batch's unmeasured candidates |
| `leases.py` | leasing batches (fair share, FIFO, `SKIP LOCKED`), heartbeats, expiry, `lease_withheld` |
| `agents.py` | registration, releasing what an agent does not hold, quarantine and flags, offline |
| `measurements.py` | exactly-once measurements and build errors, new bests, abandoned batches |
| `cost_models.py` | saved versions of the class cost models |
| `model_runs.py` | tuned models run on an agent of their class |
| `device_classes.py` | device classes by name, created when missing |
| `stored_files.py` | the files rows name under the artifact root: a batch's kernels, a workload's task data |
| `build_locks.py` | who is building a batch now (session-level advisory locks of the build workers) |
| `confirmations.py`, `trust.py`, `timing_floor.py` | believing agents: confirmations, standing, the timing floor |
| `liveness.py`, `revocations.py` | who is online; token revocations pushed to the lease services |
| `codec.py` | the JSON forms of records kept in JSONB columns |
| `teams.py` | teams, and what a team has in progress (its quota) |
| `uploads.py` | the models teams upload: their task tables and workloads |
| `jobs.py` | a team's jobs: created, listed, their progress (`job_overview`), cancelled, their records |
| `devices.py` | the agents and device classes teams see, the database's clock |
| `dashboard_sessions.py` | the dashboard's server-side sessions |
| `database_metrics.py` | the farm's counts for `GET /metrics` |
| `job_store.py`, `job_locks.py` | the scheduler's side of jobs: claiming, progress, finishing; the per-job advisory locks |
| `farm_batches.py`, `farm_tasks.py` | what a job's farm measurer writes and polls: batches, workloads, task data, job tasks |
| `class_models.py`, `model_checks.py` | what the class models learn from (vouched measurements); a tuned model's run |
| `database_admin.py`, `synthetic_load.py` | `farm up`'s checks; the rows the farm benchmarks make up |
| `migrations/` | env.py and the revisions |

Operations work inside the caller's transaction (`session.transaction`) and commit nothing
themselves. Lock order, kept by every operation here so that concurrent callers cannot deadlock:
batches -> leases -> measurements -> confirmations -> job_tasks -> jobs -> model_runs -> agents.
Code that locks several of these in one transaction keeps the same order. (A new best's
confirmation is scheduled after its task's row is updated: it updates the measurement the
same transaction has just inserted, which no other transaction can lock.)

Nothing here starts a process or knows about HTTP, gRPC or RQ: the services build on it.
"""
