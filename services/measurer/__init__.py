"""Running built kernels on a device and timing them (a local process now; gRPC agents later)."""
