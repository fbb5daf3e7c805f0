"""The device agent (`tunefarm agent`, `python -m services.agent`): what a board runs.

It leases batches of built kernels from the lease service, fetches them, runs each in a
sandboxed process and streams the results back over gRPC (services/protocol); it also
runs and times every tuned model of its class, beside onnxruntime (and OpenVINO where
installed) on the same input and threads.

| module | what it holds |
|---|---|
| `agent.py` | the loop: register, lease, measure, model runs, heartbeats and the leases it holds (`DeviceAgent`, `run_agent`) |
| `settings.py` | `AgentSettings`: flags and TUNEFARM_AGENT_* variables, and what they refuse |
| `channel.py` | the channel to the lease service (TLS or not), backoff, the errors no retry fixes |
| `files.py` | downloads (one Fetch stream per lease), and which files are accepted (digest, signature) |
| `model_runs.py` | a leased model run's files made the runner's input, and its result the report |
| `kernel_files.py` | where the files the sandboxed kernel process reads are kept, under names the agent makes |
| `results.py` | a lease's results stream: resent until acknowledged, then finished |
| `capabilities.py` | what the agent reports about its machine (CPU, ISA, GPU, emulation) |
| `cli.py`, `__main__.py` | the command line |

The agent needs only TVM's runtime, numpy, grpcio, protobuf and cryptography (the
`agent` extra): it imports `tunefarm.measure` (the runner, task data), core modules of
`tunefarm` other than the search, and `services.protocol`; nothing of the database, the
queues, the scheduler or the other services (tests/test_layering.py checks it).

What an agent trusts, and what it does not (it loads native code that came over the
network):

- the server: TLS (`--tls`, `--tls-ca`, ...) to anything but this machine; plaintext to
  another host is refused unless `--insecure-plaintext` says so (the token would travel
  in clear, and anyone on the path could answer in the server's place): `settings.py`,
  `channel.py`;
- the code: a kernel or model library is loaded only when the farm's signature on it
  verifies with the farm's public key (`--signing-public-key`; services/protocol/signing.py),
  over the sha256 of the bytes received: anything else is a RUN_ERROR result, deleted
  unloaded. An agent without the key does not start unless `--accept-unsigned-code`:
  `files.py`. The ONNX graph the peers (onnxruntime, OpenVINO) are timed on is data, but
  native parsers read it: it is checked the same way (unsigned, the peers are not timed);
- file names: a kernel is saved as `<candidate id><suffix>` (one of `LOADABLE_SUFFIXES`),
  task data as `<sha256>.npz` with the sha256 checked to be 64 hex digits and to be that
  of the bytes received: nothing a server sends names a path: `files.py`, `kernel_files.py`;
- the kernels (and the peers timed beside a tuned model, each in a child of its own):
  they run in a sandboxed child (`tunefarm.isolation.Sandbox`): when the
  agent runs as root, as `--kernel-user` (default nobody) in a network namespace of its
  own; otherwise as the agent's user, without network where unprivileged user
  namespaces are allowed. The agent logs which protections are active when it starts.
  The files a kernel needs are readable by that user's group only (a lease's own
  directory writable), under the work directory, or, when a parent of it is closed to
  that user (/root), under a private temporary directory: `agent.py`, `kernel_files.py`;
- the registration: `Register` answers with a secret for this run of the agent, kept in
  memory only and sent with every later call (`x-tunefarm-agent-secret`): another process
  with the same token cannot act as this agent. A registration under the same name
  elsewhere replaces it; this agent is then refused and stops (PermissionDenied): `agent.py`.
"""
