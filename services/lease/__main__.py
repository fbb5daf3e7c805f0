"""`python -m services.lease`: the `tunefarm lease-service` command."""

from services.lease.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
