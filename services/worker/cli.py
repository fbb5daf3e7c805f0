"""`tunefarm worker` (`python -m services.worker`): a `BuildWorker` (an RQ SimpleWorker) on
the build queues of the farm's device classes, running `services.worker.jobs.build_batch`
for the JSON build jobs it accepts (`services.worker.build_job`), and waiting for Redis
across a restart (`services.worker.redis_wait`)."""

from __future__ import annotations

import argparse
import logging

from redis import Redis

from services.db.device_classes import device_class_names
from services.db.session import make_session_factory, transaction
from services.protocol.signing import KeyFileError
from services.worker.build_worker import build_worker
from services.worker.jobs import configure, log, shutdown
from services.worker.settings import WorkerSettings


def main(argv: list[str] | None = None) -> int:
    """`tunefarm worker [--device-class C ...] [--every-class] [--burst] [--name N]`: a
    build worker on the build queues of the given device classes; without any, or with
    `--every-class`, also of every class in the database, those created later included
    (`BuildWorker.serve_new_classes`)."""
    parser = argparse.ArgumentParser(prog="tunefarm worker", description="build batches for the farm's agents")
    parser.add_argument("--device-class", action="append", help="a class whose batches to build (repeat)")
    parser.add_argument("--every-class", action="store_true",
                        help="also every other class of the database, and each class created later "
                             "(the default without --device-class)")  # fmt: skip
    parser.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    parser.add_argument("--name", help="RQ worker name (default: RQ's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings()
    sessions = make_session_factory(settings)

    def every_class() -> list[str]:
        with transaction(sessions) as s:
            return device_class_names(s, by_id=True)

    follow = args.every_class or not args.device_class
    classes = list(dict.fromkeys([*(args.device_class or []), *(every_class() if follow else [])]))
    if not classes:
        print("tunefarm worker: error: no device class exists yet; pass --device-class", flush=True)
        return 2
    try:
        configure(settings, sessions=sessions)
    except KeyFileError as exc:
        print(f"tunefarm worker: error: {exc}", flush=True)
        return 2
    try:
        redis = Redis.from_url(settings.redis_url)
        log.info("building for %s", ", ".join(classes))
        worker = build_worker(redis, classes, settings.queue_prefix, name=args.name,
                              every_class=every_class if follow else None)  # fmt: skip
        worker.work(burst=args.burst, with_scheduler=False)
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
