"""kvtier's vLLM connectors and the tier client they share (the ``kvtier-connector`` distribution).

Four parts, each a package, and what both connectors share (docs/connector.md, "The code")::

    client/    the tier client (TierClient, public as kvtier.connector.client.TierClient)
               and its transports
    chunks/    keys, encoder keys and the stored chunk format (no vLLM, torch or client)
    kv/        the KV connector's halves; its front is kvtier.connector.vllm (KvtierConnector)
    encoder/   the encoder-cache connector's halves; its front is kvtier.connector.ec
               (KvtierECConnector)
    config.py, factory.py, sender.py, metrics.py, tiercalls.py, errors.py: shared by both
"""
