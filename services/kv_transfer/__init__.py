"""Moving a prompt's KV between engines: contract, handles, handshake, leases, data paths."""

# Import the modules by name: this package file imports nothing, so `kv_transfer.handle` loads
# without torch.
