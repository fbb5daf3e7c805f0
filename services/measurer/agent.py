"""A shim, kept for one release: `python -m services.measurer.agent` runs the device agent.

The agent now lives in services/agent/ (`python -m services.agent`, `tunefarm agent`);
this module only calls its command line's `main`.
"""

from services.agent.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
