from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_KIND_UNSPECIFIED: _ClassVar[StateKind]
    STATE_KIND_RECURRENT: _ClassVar[StateKind]
    STATE_KIND_CONV: _ClassVar[StateKind]
STATE_KIND_UNSPECIFIED: StateKind
STATE_KIND_RECURRENT: StateKind
STATE_KIND_CONV: StateKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("seed", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "grammar", "n")
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    seed: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    grammar: str
    n: int
    def __init__(self, seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ImageRef(_message.Message):
    __slots__ = ("cache_key", "encoder_address", "cache_salt", "grid_thw", "placeholder_tokens", "layout_variant", "embedding", "image_data")
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VARIANT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DATA_FIELD_NUMBER: _ClassVar[int]
    cache_key: str
    encoder_address: str
    cache_salt: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    placeholder_tokens: int
    layout_variant: str
    embedding: Tensor
    image_data: bytes
    def __init__(self, cache_key: _Optional[str] = ..., encoder_address: _Optional[str] = ..., cache_salt: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., placeholder_tokens: _Optional[int] = ..., layout_variant: _Optional[str] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ..., image_data: _Optional[bytes] = ...) -> None: ...

class TimingSample(_message.Message):
    __slots__ = ("kind", "size", "ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    size: float
    ms: float
    def __init__(self, kind: _Optional[str] = ..., size: _Optional[float] = ..., ms: _Optional[float] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("since_sample", "prefix_summary_version")
    SINCE_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    since_sample: int
    prefix_summary_version: str
    def __init__(self, since_sample: _Optional[int] = ..., prefix_summary_version: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "address", "serving", "queue_depth", "in_flight", "running_seqs", "free_blocks", "total_blocks", "block_size", "reservations_active", "pending_chunks", "queued_prefill_tokens", "computes", "cache_hits", "samples", "last_sample", "model_fingerprint", "max_batch", "preprocess_digest", "lease_reaped_total", "bulk_address", "single_flight_in_flight", "max_batch_configured", "attention_kernel", "cached_blocks", "prefix_cache", "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_summary_version", "prefix_summary_sent", "prefix_summary", "free_state_slots", "total_state_slots", "choices_retired_early_total", "ring_groups", "ring_blocks", "linear_kernel", "queued_prompt_tokens", "host_id", "cpus", "cpus_busy", "step_prompt_tokens", "step_long_prompt_tokens", "queued_image_tokens")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PENDING_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LAST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_REAPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SINGLE_FLIGHT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_KERNEL_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_RETIRED_EARLY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    RING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LINEAR_KERNEL_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    CPUS_BUSY_FIELD_NUMBER: _ClassVar[int]
    STEP_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_LONG_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    serving: bool
    queue_depth: int
    in_flight: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    block_size: int
    reservations_active: int
    pending_chunks: int
    queued_prefill_tokens: int
    computes: int
    cache_hits: int
    samples: _containers.RepeatedCompositeFieldContainer[TimingSample]
    last_sample: int
    model_fingerprint: str
    max_batch: int
    preprocess_digest: str
    lease_reaped_total: int
    bulk_address: str
    single_flight_in_flight: int
    max_batch_configured: int
    attention_kernel: str
    cached_blocks: int
    prefix_cache: bool
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prefix_summary_version: str
    prefix_summary_sent: bool
    prefix_summary: _containers.RepeatedScalarFieldContainer[int]
    free_state_slots: int
    total_state_slots: int
    choices_retired_early_total: int
    ring_groups: int
    ring_blocks: int
    linear_kernel: str
    queued_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    host_id: str
    cpus: _containers.RepeatedScalarFieldContainer[int]
    cpus_busy: float
    step_prompt_tokens: int
    step_long_prompt_tokens: int
    queued_image_tokens: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., serving: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., running_seqs: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., reservations_active: _Optional[int] = ..., pending_chunks: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., computes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[TimingSample, _Mapping]]] = ..., last_sample: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., max_batch: _Optional[int] = ..., preprocess_digest: _Optional[str] = ..., lease_reaped_total: _Optional[int] = ..., bulk_address: _Optional[str] = ..., single_flight_in_flight: _Optional[int] = ..., max_batch_configured: _Optional[int] = ..., attention_kernel: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., prefix_cache: _Optional[bool] = ..., prefix_cache_queries_total: _Optional[int] = ..., prefix_cache_hits_total: _Optional[int] = ..., prefix_summary_version: _Optional[str] = ..., prefix_summary_sent: _Optional[bool] = ..., prefix_summary: _Optional[_Iterable[int]] = ..., free_state_slots: _Optional[int] = ..., total_state_slots: _Optional[int] = ..., choices_retired_early_total: _Optional[int] = ..., ring_groups: _Optional[int] = ..., ring_blocks: _Optional[int] = ..., linear_kernel: _Optional[str] = ..., queued_prompt_tokens: _Optional[_Iterable[int]] = ..., host_id: _Optional[str] = ..., cpus: _Optional[_Iterable[int]] = ..., cpus_busy: _Optional[float] = ..., step_prompt_tokens: _Optional[int] = ..., step_long_prompt_tokens: _Optional[int] = ..., queued_image_tokens: _Optional[int] = ...) -> None: ...

class EncodeImage(_message.Message):
    __slots__ = ("ref", "data")
    REF_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ref: ImageRef
    data: bytes
    def __init__(self, ref: _Optional[_Union[ImageRef, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "return_embeddings", "images", "inline_up_to_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RETURN_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    INLINE_UP_TO_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    return_embeddings: bool
    images: _containers.RepeatedCompositeFieldContainer[EncodeImage]
    inline_up_to_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., return_embeddings: _Optional[bool] = ..., images: _Optional[_Iterable[_Union[EncodeImage, _Mapping]]] = ..., inline_up_to_bytes: _Optional[int] = ...) -> None: ...

class EncodedImage(_message.Message):
    __slots__ = ("cache_key", "cache_hit", "tokens", "embedding", "grid_thw", "layout_variant")
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VARIANT_FIELD_NUMBER: _ClassVar[int]
    cache_key: str
    cache_hit: bool
    tokens: int
    embedding: Tensor
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    layout_variant: str
    def __init__(self, cache_key: _Optional[str] = ..., cache_hit: _Optional[bool] = ..., tokens: _Optional[int] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., layout_variant: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("images", "encode_ms")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[EncodedImage]
    encode_ms: float
    def __init__(self, images: _Optional[_Iterable[_Union[EncodedImage, _Mapping]]] = ..., encode_ms: _Optional[float] = ...) -> None: ...

class StoredEmbedding(_message.Message):
    __slots__ = ("cache_key", "embedding")
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    cache_key: str
    embedding: Tensor
    def __init__(self, cache_key: _Optional[str] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[StoredEmbedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[StoredEmbedding, _Mapping]]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("cache_keys",)
    CACHE_KEYS_FIELD_NUMBER: _ClassVar[int]
    cache_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CachedResponse(_message.Message):
    __slots__ = ("cached",)
    CACHED_FIELD_NUMBER: _ClassVar[int]
    cached: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, cached: _Optional[_Iterable[bool]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "generation")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    generation: int
    def __init__(self, reservation_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "max_tokens", "deadline_unix_ms", "token_digest", "model_fingerprint", "rope_delta", "prefix_keys", "reuse_prefix", "choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KEYS_FIELD_NUMBER: _ClassVar[int]
    REUSE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    max_tokens: int
    deadline_unix_ms: int
    token_digest: str
    model_fingerprint: str
    rope_delta: int
    prefix_keys: _containers.RepeatedScalarFieldContainer[bytes]
    reuse_prefix: bool
    choices: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., token_digest: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., rope_delta: _Optional[int] = ..., prefix_keys: _Optional[_Iterable[bytes]] = ..., reuse_prefix: _Optional[bool] = ..., choices: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation", "blocks", "alloc_ms", "bulk_address", "cached_tokens")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_MS_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    blocks: int
    alloc_ms: float
    bulk_address: str
    cached_tokens: int
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., blocks: _Optional[int] = ..., alloc_ms: _Optional[float] = ..., bulk_address: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RearmRequest(_message.Message):
    __slots__ = ("request_id", "reservation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation: Reservation
    def __init__(self, request_id: _Optional[str] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "reservation", "chunk_index", "layer_start", "layer_end", "token_start", "token_end", "dtype", "shape", "payload", "checksum", "last", "total_chunks", "first_token", "token_digest", "model_fingerprint", "prefill_ms", "payload_bytes", "rope_delta", "first_logprobs", "sliding_from", "state_parts", "choice_first_tokens", "choice_first_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_FROM_FIELD_NUMBER: _ClassVar[int]
    STATE_PARTS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation: Reservation
    chunk_index: int
    layer_start: int
    layer_end: int
    token_start: int
    token_end: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    checksum: str
    last: bool
    total_chunks: int
    first_token: int
    token_digest: str
    model_fingerprint: str
    prefill_ms: float
    payload_bytes: int
    rope_delta: int
    first_logprobs: TokenLogprobs
    sliding_from: int
    state_parts: _containers.RepeatedCompositeFieldContainer[StatePart]
    choice_first_tokens: _containers.RepeatedScalarFieldContainer[int]
    choice_first_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., chunk_index: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[str] = ..., last: _Optional[bool] = ..., total_chunks: _Optional[int] = ..., first_token: _Optional[int] = ..., token_digest: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., prefill_ms: _Optional[float] = ..., payload_bytes: _Optional[int] = ..., rope_delta: _Optional[int] = ..., first_logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., sliding_from: _Optional[int] = ..., state_parts: _Optional[_Iterable[_Union[StatePart, _Mapping]]] = ..., choice_first_tokens: _Optional[_Iterable[int]] = ..., choice_first_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StatePart(_message.Message):
    __slots__ = ("layer", "kind", "dtype", "shape", "data", "checksum")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kind: StateKind
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    checksum: str
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[_Union[StateKind, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., checksum: _Optional[str] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "rejected", "state", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    rejected: int
    state: str
    detail: str
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., state: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "reservation", "max_tokens", "sampling", "deadline_unix_ms", "colocated", "token_ids", "images", "chunk_tokens", "cache_salt", "reserve")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation: Reservation
    max_tokens: int
    sampling: SamplingParams
    deadline_unix_ms: int
    colocated: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageRef]
    chunk_tokens: int
    cache_salt: str
    reserve: ReserveRequest
    def __init__(self, request_id: _Optional[str] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., colocated: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ..., chunk_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., reserve: _Optional[_Union[ReserveRequest, _Mapping]] = ...) -> None: ...

class TransferMetric(_message.Message):
    __slots__ = ("transfer_latency_s", "alloc_latency_s", "transfer_total_bytes", "chunks", "prefill_ms")
    TRANSFER_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ALLOC_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_latency_s: float
    alloc_latency_s: float
    transfer_total_bytes: int
    chunks: int
    prefill_ms: float
    def __init__(self, transfer_latency_s: _Optional[float] = ..., alloc_latency_s: _Optional[float] = ..., transfer_total_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "transfer", "queue_ms", "first_step_ms", "logprobs", "index", "reserved")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    transfer: TransferMetric
    queue_ms: float
    first_step_ms: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    reserved: ReserveResponse
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., transfer: _Optional[_Union[TransferMetric, _Mapping]] = ..., queue_ms: _Optional[float] = ..., first_step_ms: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., reserved: _Optional[_Union[ReserveResponse, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reservation", "reason", "choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation: Reservation
    reason: str
    choices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., reason: _Optional[str] = ..., choices: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GenerateOpen(_message.Message):
    __slots__ = ("call", "start", "cancel", "timeout_s")
    CALL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call: int
    start: GenerateRequest
    cancel: bool
    timeout_s: float
    def __init__(self, call: _Optional[int] = ..., start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class GenerateOpens(_message.Message):
    __slots__ = ("opens",)
    OPENS_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[GenerateOpen]
    def __init__(self, opens: _Optional[_Iterable[_Union[GenerateOpen, _Mapping]]] = ...) -> None: ...

class StatusEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class GenerateEnd(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[StatusEntry]
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[StatusEntry, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("call", "event", "end")
    CALL_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call: int
    event: TokenEvent
    end: GenerateEnd
    def __init__(self, call: _Optional[int] = ..., event: _Optional[_Union[TokenEvent, _Mapping]] = ..., end: _Optional[_Union[GenerateEnd, _Mapping]] = ...) -> None: ...

class GenerateEvents(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[GenerateEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[GenerateEvent, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "images", "sampling", "decode_address", "reservation", "chunk_tokens", "deadline_unix_ms", "token_digest", "decode_bulk_address", "rope_delta")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DECODE_BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedCompositeFieldContainer[ImageRef]
    sampling: SamplingParams
    decode_address: str
    reservation: Reservation
    chunk_tokens: int
    deadline_unix_ms: int
    token_digest: str
    decode_bulk_address: str
    rope_delta: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., chunk_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., token_digest: _Optional[str] = ..., decode_bulk_address: _Optional[str] = ..., rope_delta: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "chunks_sent", "bytes_sent")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    chunks_sent: int
    bytes_sent: int
    def __init__(self, first_token: _Optional[int] = ..., chunks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ...) -> None: ...
