"""Fleet fill: nodes serve their verified blobs to each other, so the origin serves each model about once.

`server.PeerServer` (import it from its module: it needs aiohttp) serves this node's blobs; `client.PeerClient`
talks to one peer; `source.PeerSet` wraps a fetch's Source so trusted blobs come from peers first, then the
origin. Design and trust: docs/peers.md.
"""

from weightcache.peers.client import PeerClient, peer_base_url
from weightcache.peers.source import PeerSet, PeerSource, PeerStats

__all__ = ["PeerClient", "PeerSet", "PeerSource", "PeerStats", "peer_base_url"]
