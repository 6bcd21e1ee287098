"""Keys and the stored chunk format; imports neither vLLM, torch nor the tier client.

``keys`` (KV chunk keys, docs/keys.md), ``encoder_keys`` (encoder-output keys,
docs/encoder-cache.md), ``codec`` (the self-describing chunk both store), and
``_keyhash`` (an optional C helper of ``keys``; pure Python without it).
"""
