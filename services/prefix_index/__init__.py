"""Which worker holds which cached prompt prefix: the index (in memory, Redis), its publisher."""
