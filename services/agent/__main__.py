"""`python -m services.agent`: the `tunefarm agent` command."""

from services.agent.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
