"""The vLLM KV connector's halves; its front, ``KvtierConnector``, is ``kvtier.connector.vllm``.

``scheduler`` (keys and one Lookup per request, the step's plan), ``worker`` (chunks
into and out of the paged KV cache), ``plan`` (what the scheduler tells the workers),
``groups`` (KV cache groups: what each stores of a chunk, what a hit loads),
``vllmspec`` (vLLM's KV cache config read: groups, their content, their keys),
``layouts`` (the KV layouts of vLLM's attention backends), ``streams`` and ``copies``
(the worker's block copies, asynchronous on a GPU), ``groupcopies`` (one set of copies
per KV cache group).
"""
