"""Sending a round's pieces: each written once, behind its guard, on its part's node.

Per piece, on a connection to the node of the part's slot: ``WATCH`` the part's keys,
:data:`~embgeom.store.scripts.GUARD_PIECE`, ``MULTI``, plain ``HSET`` of its records, its
marker, ``EXEC``. Parts are sent in order by one sender thread as soon as they are merged,
and every piece's replies are read at the end of the round (one round trip per node).
What a refusal, a lost lock or an aborted ``EXEC`` means for the round is told in
:mod:`embgeom.store.shards`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import redis

from embgeom.errors import (CheckpointRefused, CheckTooOld, EmbgeomError, GenerationDeleted,
                            StoreUnavailable)
from embgeom.store.scripts import GUARD_PIECE

__all__ = ["PieceWriter", "piece_result", "refusal"]

# Error replies that mean "not now" rather than "never": the server is loading its data
# or busy with a script, a cluster slot or a replica is failing over. Anything else
# (a script error, WRONGTYPE, OOM under noeviction) comes back the same on a retry.
TRANSIENT_REPLIES = frozenset({"LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN",
                               "READONLY", "NOREPLICAS", "MOVED", "ASK"})


def refusal(exc: redis.ResponseError, what: str = "a checkpoint command") -> EmbgeomError:
    """An error reply of Redis as the library's error: :class:`StoreUnavailable` (retried
    with backoff) when it is transient, else :class:`CheckpointRefused` (not retried
    blindly). redis-py strips some codes into exception classes and prefixes a
    pipeline's errors with the command, so both are looked at."""
    text = str(exc.args[0]) if exc.args else str(exc)
    code = text.rsplit("caused error: ", 1)[-1].split(" ", 1)[0]
    transient = (code in TRANSIENT_REPLIES
                 or isinstance(exc, (redis.exceptions.ReadOnlyError, redis.exceptions.BusyLoadingError))
                 or type(exc).__name__ in ("TryAgainError", "ClusterDownError", "MasterDownError",
                                        # a piece's writes go to the node of its slot as the
                                        # client knew it (no redirection followed)
                                        "MovedError", "AskError"))
    cls = StoreUnavailable if transient else CheckpointRefused
    return cls(f"{what} was refused by Redis: {text.rsplit('caused error: ', 1)[-1]}")


class PieceWriter:
    """Writes the pieces of a round's merged parts, each behind its guard (one writer per
    :class:`~embgeom.store.shards.ShardWriter`)."""

    def __init__(self, client: redis.Redis, max_age_ms: int = 600_000):
        self.r = client
        self.max_age_ms = max_age_ms
        self._sender_pool: Optional[ThreadPoolExecutor] = None

    def write(self, parts, cp, fence, checked, writes, stats) -> list:
        """Write the parts ``writes`` yields (``(part, {"marks", "calls"})``, see
        ``ShardWriter._merge``); returns the parts finished. Per piece, on a connection to
        the part's node: ``WATCH``, :data:`GUARD_PIECE`, ``MULTI``, plain ``HSET`` of its
        records, its marker, ``EXEC``. A part is sent (by one sender thread, in order)
        as soon as it is merged; the replies of every piece are read at the end, so the
        round costs one round trip per node and ``appendfsync always`` syncs once for
        many pieces."""
        nodes: dict[int, list] = {}  # node -> [client, connection, [(part, piece, last, n)], replies]
        sends = []
        try:
            for s, w in writes:
                keys = parts.shard(*s)
                client = self._node(keys.lock)
                node = nodes.get(id(client))
                if node is None:
                    node = nodes[id(client)] = [client, client.connection_pool.get_connection(), [], 0]
                commands = self._part_commands(keys, cp, fence, checked, w, node[2], s, stats)
                node[3] += len(commands)
                sends.append(self._sender().submit(self._send, node[1], commands))
            for f in sends:
                f.result()
            results = []
            for client, conn, order, count in nodes.values():
                replies = iter(self._receive(conn, count))
                results += [(part, piece, last, [next(replies) for _ in range(n)])
                            for part, piece, last, n in order]
        except BaseException:
            for f in sends:  # no send may run on a connection given back
                f.cancel() or f.exception()
            for client, conn, *_ in nodes.values():
                conn.disconnect()  # replies unread, or a piece half sent (its MULTI discarded)
            raise
        finally:
            for client, conn, *_ in nodes.values():
                client.connection_pool.release(conn)
        failed_reply = next((r for *_, replies in results for r in replies
                             if isinstance(r, redis.ResponseError)), None)
        if failed_reply is not None:
            raise refusal(failed_reply, "a checkpoint write") from failed_reply
        finished, failed = set(), set()
        for s, piece, last, replies in results:
            res = piece_result(replies)
            if res == -1:
                raise GenerationDeleted(parts.pair.pair)
            if res in (1, 2):
                stats.pieces += res == 1
                if last and s not in failed:
                    finished.add(s)
                continue
            failed.add(s)
            finished.discard(s)
            stats.lost += 1
            if res == -2:
                raise CheckTooOld(f"checkpoint {cp}: its in-flight check is too old")
            if res == -3:
                raise CheckpointRefused(f"checkpoint {cp}: a key of shard {s[0]} (layer group "
                                        f"{s[1]}) holds the wrong type "
                                        "of value (WRONGTYPE); nothing of that piece was written")
        # A part with a failed piece is redone from a fresh read next round; the pieces it
        # did apply are marked and will be skipped.
        return sorted(finished)

    def _part_commands(self, keys, cp, fence, checked, w, order, s, stats) -> list:
        """The commands of one part: each live piece's (:meth:`_piece_commands`), its
        markers chained (``marks,p``); or, when every piece was applied before, only the
        lock's release. Appends ``(part, piece, last, commands)`` to ``order``."""
        live = [(piece, c) for piece, c in w["calls"] if c is not None]
        if not live:
            order.append((s, None, True, 1))
            return [("EVAL", RELEASE, 1, keys.lock, fence)]
        out, marks = [], w["marks"]
        for i, (piece, c) in enumerate(live):
            last = i == len(live) - 1
            commands = self._piece_commands(keys, cp, fence, checked, piece, last, marks, c, stats)
            marks = f"{marks},{piece}" if marks else str(piece)
            out += commands
            order.append((s, piece, last, len(commands)))
        return out

    def _piece_commands(self, keys, cp, fence, checked, piece, last, marks, c, stats) -> list:
        """The commands that write one piece once: ``WATCH`` the part's keys,
        :data:`GUARD_PIECE`, then ``MULTI`` .. ``EXEC`` of plain writes (the records, the
        bucket rows, agg, new word names; the marker ``marks,piece``; the lock's release
        after the part's last piece)."""
        watched = [keys.lock, keys.applied, keys.dead, keys.rec, keys.unit, keys.scal,
                   keys.bkt, keys.agg, keys.name, keys.gate]
        out = [("WATCH", *watched),
               ("EVAL", GUARD_PIECE.source, len(watched), *watched, fence, cp, piece, checked,
                self.max_age_ms, int(last), marks),
               ("MULTI",)]
        for name in ("rec", "unit", "scal", "bkt", "name"):
            pairs = c[name]
            if pairs:
                out.append(("HSET", getattr(keys, name), *[x for fv in pairs for x in fv]))
                stats.bytes_written += sum(len(v) for _, v in pairs)
        out.append(("SET", keys.agg, c["agg"]))
        out.append(("HSET", keys.applied, cp, f"{marks},{piece}" if marks else str(piece)))
        if last:
            out.append(("DEL", keys.lock))
        out.append(("EXEC",))
        return out

    def _node(self, key: str) -> redis.Redis:
        """The client of the node serving ``key``'s slot: the client itself on one Redis."""
        if hasattr(self.r, "get_node_from_key"):  # a RedisCluster
            return self.r.get_redis_connection(self.r.get_node_from_key(key))
        return self.r

    def _sender(self) -> ThreadPoolExecutor:
        """The one thread that sends this writer's pieces, in order (created on first use)."""
        if self._sender_pool is None:
            self._sender_pool = ThreadPoolExecutor(1, thread_name_prefix="embgeom-shard-send")
        return self._sender_pool

    @staticmethod
    def _send(conn, commands: list) -> None:
        conn.send_packed_command(conn.pack_commands(commands))

    @staticmethod
    def _receive(conn, count: int) -> list:
        """``count`` replies from ``conn``, an error reply as its exception."""
        out = []
        for _ in range(count):
            try:
                out.append(conn.read_response())
            except redis.ResponseError as exc:
                out.append(exc)
        return out


# Release a part's lock if it is still ours (a part whose pieces were all applied before).
RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 2"


def piece_result(replies: list) -> int:
    """A piece's outcome from its commands' replies (``WATCH``, the guard, ``MULTI``, the
    queued writes, ``EXEC``): the guard's code, but 0 (lost: redone from a fresh read)
    when the guard let it through and ``EXEC`` was aborted (a watched key changed, or the
    lock's lease lapsed, between them); the unlock-only ``EVAL`` of a part with nothing
    left answers 2."""
    if len(replies) == 1:
        return int(replies[0])
    guard, executed = int(replies[1]), replies[-1]
    if guard == 1 and executed is None:
        return 0
    return guard
