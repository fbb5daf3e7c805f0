"""What the device agents and the lease service share: the wire between them.

| module | what it holds |
|---|---|
| `generated/` | protoc's output for proto/tunefarm/v1/measurer.proto (`make proto`, never edited) |
| `proto_build.py` | the command that regenerates `generated/` (`python -m services.protocol.proto_build`) |
| `wire.py` | protobuf messages <-> tunefarm's plain records; the metadata of a call (token, agent secret) |
| `errors.py` | the agent service's errors and their gRPC status codes, both ways (`status_of`, `from_rpc_error`) |
| `signing.py` | the farm's Ed25519 signature on kernels and models (build side signs, agents check) |

Both sides import this package, so it imports only grpc, protobuf, cryptography and
tunefarm's core records: nothing of the database, the queues or the search.
"""
