"""Shims, kept for one release, of the entry points that lived here.

| module | runs | the code now lives in |
|---|---|---|
| `agent.py` | `python -m services.measurer.agent` | services/agent/ (`python -m services.agent`) |
| `lease_service.py` | `python -m services.measurer.lease_service` | services/lease/ (`python -m services.lease`) |

The wire both sides speak (generated gRPC code, messages, errors, signatures) is
services/protocol/; the artifact root's layout is services/common/artifacts.py.
"""
