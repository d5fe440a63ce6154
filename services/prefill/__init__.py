"""The prefill worker process: a gRPC servicer around an engine in PREFILL role."""
