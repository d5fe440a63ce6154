"""The gRPC control plane all KV data paths share: handshake, leases, release, path set-up."""
