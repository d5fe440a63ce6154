"""Process plumbing: gRPC server and errors, channels, request ids, logs, metrics, member leases."""
