from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(_message.Message):
    __slots__ = ("role", "address", "healthy", "info", "error")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    healthy: bool
    info: _common_pb2.WorkerInfo
    error: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., info: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class WorkerList(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "kv_handle", "first_logprob", "num_cached_tokens", "queue_seconds", "compute_seconds")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    kv_handle: _common_pb2.KVHandle
    first_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    queue_seconds: float
    compute_seconds: float
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_handle", "cache_salt", "output_token_ids", "itl_objective_ms", "tpot_objective_ms", "ttft_objective_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ITL_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_handle: _common_pb2.KVHandle
    cache_salt: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    itl_objective_ms: float
    tpot_objective_ms: float
    ttft_objective_ms: float
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., cache_salt: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., itl_objective_ms: _Optional[float] = ..., tpot_objective_ms: _Optional[float] = ..., ttft_objective_ms: _Optional[float] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "kv_transfer_seconds", "logprobs", "num_cached_tokens", "queue_seconds", "compute_seconds")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    kv_transfer_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_cached_tokens: int
    queue_seconds: float
    compute_seconds: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., kv_transfer_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("role", "address", "metrics_url", "leave", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    metrics_url: str
    leave: bool
    name: str
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., metrics_url: _Optional[str] = ..., leave: _Optional[bool] = ..., name: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("num_workers", "num_hashes_dropped")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HASHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    num_hashes_dropped: int
    def __init__(self, num_workers: _Optional[int] = ..., num_hashes_dropped: _Optional[int] = ...) -> None: ...

class SharedKVSegment(_message.Message):
    __slots__ = ("name", "token", "nbytes", "num_blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    token: bytes
    nbytes: int
    num_blocks: int
    def __init__(self, name: _Optional[str] = ..., token: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ConfirmKVCopyResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class KVGroupRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class KVGroupInfo(_message.Message):
    __slots__ = ("store_host", "store_port", "group", "backend")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    group: str
    backend: str
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., group: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class SendKVRequest(_message.Message):
    __slots__ = ("pull", "group", "tag")
    PULL_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    pull: PullKVRequest
    group: str
    tag: int
    def __init__(self, pull: _Optional[_Union[PullKVRequest, _Mapping]] = ..., group: _Optional[str] = ..., tag: _Optional[int] = ...) -> None: ...

class SendKVStatus(_message.Message):
    __slots__ = ("sent",)
    SENT_FIELD_NUMBER: _ClassVar[int]
    sent: bool
    def __init__(self, sent: _Optional[bool] = ...) -> None: ...

class KVHandshakeRequest(_message.Message):
    __slots__ = ("model_id", "layout", "engine_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    layout: _common_pb2.KVLayout
    engine_id: str
    def __init__(self, model_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., engine_id: _Optional[str] = ...) -> None: ...

class KVHandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "model_id", "layout", "lease_seconds", "backends", "shared_memory", "device_type", "node_id", "cuda_ipc")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model_id: str
    layout: _common_pb2.KVLayout
    lease_seconds: float
    backends: _containers.RepeatedScalarFieldContainer[str]
    shared_memory: SharedKVSegment
    device_type: str
    node_id: str
    cuda_ipc: str
    def __init__(self, engine_id: _Optional[str] = ..., model_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., backends: _Optional[_Iterable[str]] = ..., shared_memory: _Optional[_Union[SharedKVSegment, _Mapping]] = ..., device_type: _Optional[str] = ..., node_id: _Optional[str] = ..., cuda_ipc: _Optional[str] = ...) -> None: ...

class RenewKVLeaseRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewKVLeaseResponse(_message.Message):
    __slots__ = ("renewed",)
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    renewed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, renewed: _Optional[_Iterable[bool]] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("handle", "first_block")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    handle: _common_pb2.KVHandle
    first_block: int
    def __init__(self, handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., first_block: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layout", "block_offset", "num_blocks", "data")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layout: _common_pb2.KVLayout
    block_offset: int
    num_blocks: int
    data: bytes
    def __init__(self, layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., block_offset: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
