"""The CUDA IPC data path: KV blocks copied out of the source's GPU cache through CUDA IPC."""
