"""KV transfer: how a PREFILL engine's blocks reach a DECODE engine.

Modules: `handle` (KVHandle), `lease` (the source's pins), `handshake` (layout checks), `base`
(the interfaces), `in_memory` (both ends in one process). Import them by module; this package
file imports nothing, so `kv_transfer.handle` loads without torch.
"""
