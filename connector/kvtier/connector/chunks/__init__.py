"""Keys and the stored chunk format; imports neither vLLM, torch nor the tier client.

``keys`` (KV chunk keys, docs/keys.md), ``encoder_keys`` (encoder-output keys,
docs/encoder-cache.md), ``codec`` (the self-describing chunk both store), ``finite``
(the scan of a KV chunk for NaN and infinities), and ``_keyhash`` and ``_finite``
(optional C helpers of ``keys`` and ``finite``; Python without them).
"""
