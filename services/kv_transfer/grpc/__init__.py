"""The gRPC data path: a prompt's KV blocks streamed as PullKV messages, between any two hosts."""
