"""The torch.distributed data path: KV blocks sent over a process group per P/D pair."""
