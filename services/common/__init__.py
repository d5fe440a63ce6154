"""What the services share: gRPC plumbing, error mapping, metrics, conversion, KV transfer."""
