"""Stand-ins that take no time for the farm's build and run, for `tunefarm bench farm`'s
dispatch overhead and `bench farm-load`: what is left to measure is the queue, the RPCs
and the database. Each runs as a process of its own:

    python -c "import sys; from tunefarm_app.bench.stand_ins import stand_in_worker; stand_in_worker(sys.argv[1:])" CLASS KERNEL
"""

from __future__ import annotations

import signal


def stand_in_worker(argv: list[str]) -> None:
    """An RQ SimpleWorker whose builds take no time: every candidate "builds" into the
    same 16 KB file (the agent still fetches one per candidate)."""
    from redis import Redis

    from services.worker import jobs
    from services.worker.build_worker import build_worker
    from services.worker.settings import WorkerSettings
    from tunefarm.measure.builder import Builder
    from tunefarm.records import BuildResult

    device_class, kernel = argv

    class StandInBuilder(Builder):
        def build(self, inputs):
            return [BuildResult(inp.candidate_key, kernel, 0.0) for inp in inputs]

        def close(self) -> None:
            pass

    settings = WorkerSettings()
    jobs.configure(settings, builder=StandInBuilder())
    redis = Redis.from_url(settings.redis_url)
    build_worker(redis, [device_class], settings.queue_prefix).work()


def stand_in_agent(argv: list[str]) -> None:
    """An agent whose runner answers at once (no TVM: nothing is loaded or run)."""
    import threading

    from services.agent import capabilities
    from services.agent.agent import run_agent
    from services.agent.cli import build_parser
    from services.agent.settings import AgentSettings
    from tunefarm.measure.runner import Runner
    from tunefarm.records import RunResult

    class InstantRunner(Runner):
        def run(self, inputs):
            return [RunResult(i.candidate_key, (1e-6, 1e-6, 1e-6), 0.0, verified=True) for i in inputs]

        def close(self) -> None:
            pass

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    settings = AgentSettings.from_env(**vars(args))
    caps = {**capabilities.detect(probe=False), "tvm_version": "stand-in"}
    run_agent(settings, runner=InstantRunner(), stop=stop, capabilities=caps)
