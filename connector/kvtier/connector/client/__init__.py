"""The tier client: ``TierClient`` and the transports it moves calls over.

``from kvtier.connector.client import TierClient`` is a public contract (DESIGN.md).
"""

from kvtier.connector.client.tierclient import TierClient

__all__ = ["TierClient"]
