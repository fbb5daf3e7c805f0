"""A shim, kept for one release: `python -m services.measurer.lease_service` runs the lease service.

The lease service now lives in services/lease/ (`python -m services.lease`,
`tunefarm lease-service`); this module only calls its command line's `main`.
"""

from services.lease.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
