"""The vLLM encoder-cache connector's halves; its front, ``KvtierECConnector``, is
``kvtier.connector.ec``.

``scheduler`` (fetch and verify before vLLM schedules, the step's plan), ``worker``
(verified outputs into vLLM's encoder cache, new outputs saved in the background),
``plan`` (what the scheduler tells the workers).
"""
