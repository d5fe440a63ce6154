"""The shared-memory data path: KV blocks copied out of the source's cache mapped from /dev/shm."""
