"""Redis clients from a URL: one server, or a Redis Cluster named by any of its nodes.

``redis://`` / ``rediss://`` / ``unix://`` name one Redis; ``redis+cluster://host:port``
(or ``rediss+cluster://``) a Redis Cluster, given any one of its nodes (the others are
discovered with CLUSTER SLOTS). Every transaction and script of the service touches one
hash slot, so the same code runs on both.
"""

from __future__ import annotations

from typing import Optional

import redis

__all__ = ["CLUSTER_SCHEMES", "redis_client", "async_redis_client", "is_cluster_url"]

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme in CLUSTER_SCHEMES


def _plain(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{CLUSTER_SCHEMES[scheme]}://{rest}"


def redis_client(url: str, socket_timeout: float = 60.0) -> redis.Redis:
    """A synchronous client (workers, CLI, benchmarks)."""
    if is_cluster_url(url):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(_plain(url), socket_timeout=socket_timeout,
                                     socket_connect_timeout=5, health_check_interval=10)
    return redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5,
                                health_check_interval=10)


def async_redis_client(url: str, socket_timeout: Optional[float] = None, max_connections: int = 128):
    """An asyncio client (the API's reads never block its event loop). No timeout per
    command by default: :func:`embgeom.store.plans.run_async` times each read as a whole
    (one timer, not one per command, on the hot paths)."""
    import redis.asyncio as aredis

    if is_cluster_url(url):
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(_plain(url), socket_timeout=socket_timeout,
                                     socket_connect_timeout=5)
    return aredis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=5,
                                 max_connections=max_connections)
