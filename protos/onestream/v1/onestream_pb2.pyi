import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CardState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CARD_STATE_UNSPECIFIED: _ClassVar[CardState]
    CARD_STATE_STARTING: _ClassVar[CardState]
    CARD_STATE_FREE: _ClassVar[CardState]
    CARD_STATE_BUSY: _ClassVar[CardState]
    CARD_STATE_DOWN: _ClassVar[CardState]
    CARD_STATE_LOADING: _ClassVar[CardState]
CARD_STATE_UNSPECIFIED: CardState
CARD_STATE_STARTING: CardState
CARD_STATE_FREE: CardState
CARD_STATE_BUSY: CardState
CARD_STATE_DOWN: CardState
CARD_STATE_LOADING: CardState

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

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "messages", "sampling", "max_tokens", "stop", "stop_token_ids", "deadline", "request_id", "ignore_eos", "constraint")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline: _timestamp_pb2.Timestamp
    request_id: str
    ignore_eos: bool
    constraint: OutputConstraint
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., request_id: _Optional[str] = ..., ignore_eos: _Optional[bool] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("kind", "tool_format", "tools", "tool_name", "parallel_calls")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    tool_format: str
    tools: _containers.RepeatedCompositeFieldContainer[ConstrainedTool]
    tool_name: str
    parallel_calls: bool
    def __init__(self, kind: _Optional[str] = ..., tool_format: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[ConstrainedTool, _Mapping]]] = ..., tool_name: _Optional[str] = ..., parallel_calls: _Optional[bool] = ...) -> None: ...

class ConstrainedTool(_message.Message):
    __slots__ = ("name", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class QueuePosition(_message.Message):
    __slots__ = ("position", "queue_depth")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    position: int
    queue_depth: int
    def __init__(self, position: _Optional[int] = ..., queue_depth: _Optional[int] = ...) -> None: ...

class Assigned(_message.Message):
    __slots__ = ("card", "affinity_hit")
    CARD_FIELD_NUMBER: _ClassVar[int]
    AFFINITY_HIT_FIELD_NUMBER: _ClassVar[int]
    card: Card
    affinity_hit: bool
    def __init__(self, card: _Optional[_Union[Card, _Mapping]] = ..., affinity_hit: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "generated_tokens", "drafts", "draft_tokens", "accepted_draft_tokens", "accepted_per_position", "by_source")
    class BySourceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: DraftUsage
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[DraftUsage, _Mapping]] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    BY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_draft_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    by_source: _containers.MessageMap[str, DraftUsage]
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., by_source: _Optional[_Mapping[str, DraftUsage]] = ...) -> None: ...

class DraftUsage(_message.Message):
    __slots__ = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_wait_s", "time_to_first_token_s", "prefill_s", "decode_s", "total_s", "decode_tokens_per_s")
    QUEUE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    queue_wait_s: float
    time_to_first_token_s: float
    prefill_s: float
    decode_s: float
    total_s: float
    decode_tokens_per_s: float
    def __init__(self, queue_wait_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., total_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "card", "stop_string", "stop_token_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CARD_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    timings: Timings
    card: Card
    stop_string: str
    stop_token_id: int
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., card: _Optional[_Union[Card, _Mapping]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "queued", "assigned", "chunk", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    queued: QueuePosition
    assigned: Assigned
    chunk: TokenChunk
    finished: Finished
    def __init__(self, request_id: _Optional[str] = ..., queued: _Optional[_Union[QueuePosition, _Mapping]] = ..., assigned: _Optional[_Union[Assigned, _Mapping]] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted: _Optional[_Iterable[str]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("card_id",)
    CARD_ID_FIELD_NUMBER: _ClassVar[int]
    card_id: str
    def __init__(self, card_id: _Optional[str] = ...) -> None: ...

class Card(_message.Message):
    __slots__ = ("card_id", "node_id", "gpu_index", "gpu_uuid", "device_name", "backend", "state", "metrics_endpoint", "cached_sessions", "cached_session_bytes", "restarts", "node_ip", "loading_fraction")
    CARD_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CACHED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NODE_IP_FIELD_NUMBER: _ClassVar[int]
    LOADING_FRACTION_FIELD_NUMBER: _ClassVar[int]
    card_id: str
    node_id: str
    gpu_index: int
    gpu_uuid: str
    device_name: str
    backend: str
    state: CardState
    metrics_endpoint: str
    cached_sessions: int
    cached_session_bytes: int
    restarts: int
    node_ip: str
    loading_fraction: float
    def __init__(self, card_id: _Optional[str] = ..., node_id: _Optional[str] = ..., gpu_index: _Optional[int] = ..., gpu_uuid: _Optional[str] = ..., device_name: _Optional[str] = ..., backend: _Optional[str] = ..., state: _Optional[_Union[CardState, str]] = ..., metrics_endpoint: _Optional[str] = ..., cached_sessions: _Optional[int] = ..., cached_session_bytes: _Optional[int] = ..., restarts: _Optional[int] = ..., node_ip: _Optional[str] = ..., loading_fraction: _Optional[float] = ...) -> None: ...

class ListCardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListCardsResponse(_message.Message):
    __slots__ = ("cards",)
    CARDS_FIELD_NUMBER: _ClassVar[int]
    cards: _containers.RepeatedCompositeFieldContainer[Card]
    def __init__(self, cards: _Optional[_Iterable[_Union[Card, _Mapping]]] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "card_id", "cached_tokens", "cached_bytes", "turns", "last_used", "user")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CARD_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    card_id: str
    cached_tokens: int
    cached_bytes: int
    turns: int
    last_used: _timestamp_pb2.Timestamp
    user: str
    def __init__(self, session_id: _Optional[str] = ..., card_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., cached_bytes: _Optional[int] = ..., turns: _Optional[int] = ..., last_used: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., user: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_type", "max_context", "vocab_size", "num_parameters", "has_mtp", "spec_k", "backend", "dtype", "extra", "format")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    HAS_MTP_FIELD_NUMBER: _ClassVar[int]
    SPEC_K_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_type: str
    max_context: int
    vocab_size: int
    num_parameters: int
    has_mtp: bool
    spec_k: int
    backend: str
    dtype: str
    extra: _containers.ScalarMap[str, str]
    format: str
    def __init__(self, name: _Optional[str] = ..., model_type: _Optional[str] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_parameters: _Optional[int] = ..., has_mtp: _Optional[bool] = ..., spec_k: _Optional[int] = ..., backend: _Optional[str] = ..., dtype: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ..., format: _Optional[str] = ...) -> None: ...

class GetPoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("queue_depth", "queue_capacity", "cards_free", "cards_busy", "cards_down", "cards_starting", "sessions", "draining", "in_flight")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CARDS_FREE_FIELD_NUMBER: _ClassVar[int]
    CARDS_BUSY_FIELD_NUMBER: _ClassVar[int]
    CARDS_DOWN_FIELD_NUMBER: _ClassVar[int]
    CARDS_STARTING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    queue_capacity: int
    cards_free: int
    cards_busy: int
    cards_down: int
    cards_starting: int
    sessions: int
    draining: bool
    in_flight: int
    def __init__(self, queue_depth: _Optional[int] = ..., queue_capacity: _Optional[int] = ..., cards_free: _Optional[int] = ..., cards_busy: _Optional[int] = ..., cards_down: _Optional[int] = ..., cards_starting: _Optional[int] = ..., sessions: _Optional[int] = ..., draining: _Optional[bool] = ..., in_flight: _Optional[int] = ...) -> None: ...
