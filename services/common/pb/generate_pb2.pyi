from services.common.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "cache_salt", "itl_objective_ms", "tpot_objective_ms", "ttft_objective_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ITL_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    itl_objective_ms: float
    tpot_objective_ms: float
    ttft_objective_ms: float
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., itl_objective_ms: _Optional[float] = ..., tpot_objective_ms: _Optional[float] = ..., ttft_objective_ms: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft", "e2e", "tokenize", "prefill", "kv_transfer", "decode", "router_queue", "prefill_queue", "decode_queue", "first_decode_step", "path", "migrations", "migration", "path_reason", "predicted_ttft_local", "predicted_ttft_remote")
    TTFT_FIELD_NUMBER: _ClassVar[int]
    E2E_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_FIELD_NUMBER: _ClassVar[int]
    PATH_REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_LOCAL_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_REMOTE_FIELD_NUMBER: _ClassVar[int]
    ttft: float
    e2e: float
    tokenize: float
    prefill: float
    kv_transfer: float
    decode: float
    router_queue: float
    prefill_queue: float
    decode_queue: float
    first_decode_step: float
    path: str
    migrations: int
    migration: float
    path_reason: str
    predicted_ttft_local: float
    predicted_ttft_remote: float
    def __init__(self, ttft: _Optional[float] = ..., e2e: _Optional[float] = ..., tokenize: _Optional[float] = ..., prefill: _Optional[float] = ..., kv_transfer: _Optional[float] = ..., decode: _Optional[float] = ..., router_queue: _Optional[float] = ..., prefill_queue: _Optional[float] = ..., decode_queue: _Optional[float] = ..., first_decode_step: _Optional[float] = ..., path: _Optional[str] = ..., migrations: _Optional[int] = ..., migration: _Optional[float] = ..., path_reason: _Optional[str] = ..., predicted_ttft_local: _Optional[float] = ..., predicted_ttft_remote: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "timings", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
