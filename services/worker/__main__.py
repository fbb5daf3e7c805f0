"""`python -m services.worker`: the build worker (`services.worker.cli`)."""

from services.worker.cli import main

raise SystemExit(main())
