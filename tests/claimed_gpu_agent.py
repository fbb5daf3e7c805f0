"""A device agent that claims an NVIDIA GPU this machine does not have, for farm tests of
CUDA classes on machines without one (`farm up`'s `agent_command`).

It is the real agent (`services.agent`, settings from the TUNEFARM_AGENT_* environment
`farm up` gives it, started as with `--gpu`) with the GPU fields of its capabilities
given (`CLAIMED`) instead of probed: it registers for a CUDA class of that compute
capability, leases its batches and model runs, fetches and checks their `.cuda.tar`
files, and its runner fails each (no CUDA device here), which is what those tests need.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLAIMED = {
    "gpu_name": "NVIDIA H100 80GB HBM3",
    "gpu_compute_capability": "9.0",
    "gpu_max_threads_per_block": 1024,
    "gpu_warp_size": 32,
}


def main() -> int:
    from services.agent import capabilities
    from services.agent.agent import run_agent
    from services.agent.settings import AgentSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = AgentSettings.from_env(gpu=True)
    caps = {**capabilities.detect(), **CLAIMED}
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_agent(settings, stop=stop, capabilities=caps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
