"""The data paths a decode worker's KV receiver pulls blocks over, one per backend, all behind
the same gRPC control plane (handshake, leases, release: `control/`):

- `kv_transfer/grpc/receiver.py`: the blocks stream as PullKV messages (any two hosts);
- `kv_transfer/shared_memory/receiver.py`: copied in place out of the source's mapped cache: its
  shared-memory segment (same host, CPU) or its GPU memory through CUDA IPC (same GPU or peer
  GPUs);
- `kv_transfer/torch_dist/receiver.py`: sent through a torch.distributed process group per
  prefill/decode pair (NCCL between GPUs, which takes NVLink where the GPUs have it; gloo between
  CPU processes).

`choose` picks one per source from what its handshake offers and `--kv-transfer-backend`.
"""

KV_TRANSFER_BACKENDS = ("auto", "grpc", "shared_memory", "cuda_ipc", "torch_dist")
"""Values of `--kv-transfer-backend`: "auto" takes shared memory between CPU workers of one
host, CUDA IPC between GPU workers on one GPU or peer GPUs, torch.distributed between other GPU
workers of one node, gRPC otherwise."""
