"""Encoder cache: content-keyed image embeddings shared by every encoder replica.

Public surface (see cache/README.md):

    keys:      image_content_key, image_content_key_from_bytes, image_digest,
               content_key, preprocess_digest
    interface: EncoderCache, Fetched, ComputeFn
    opening:   open_encoder_cache, open_encoder_cache_for_settings,
               open_encoder_cache_from_config, EncoderCacheConfig
    backends:  MemoryEncoderCache, RedisEncoderCache
"""

from cache.config import EncoderCacheConfig
from cache.encoder_cache import ComputeFn, EncoderCache, Fetched
from cache.factory import open_encoder_cache, open_encoder_cache_from_config, open_encoder_cache_for_settings
from cache.keys import content_key, image_content_key, image_content_key_from_bytes, image_digest, preprocess_digest
from cache.memory_backend import MemoryEncoderCache
from cache.redis_backend import RedisEncoderCache

__all__ = [
    "ComputeFn",
    "EncoderCache",
    "EncoderCacheConfig",
    "Fetched",
    "MemoryEncoderCache",
    "RedisEncoderCache",
    "content_key",
    "image_content_key",
    "image_content_key_from_bytes",
    "image_digest",
    "open_encoder_cache",
    "open_encoder_cache_from_config",
    "open_encoder_cache_for_settings",
    "preprocess_digest",
]
