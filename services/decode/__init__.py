"""The decode worker process: a gRPC servicer around an engine in DECODE role."""
