"""A checkpoint piece is written by plain HSETs in a WATCHed MULTI behind a guard script
(:data:`embgeom.store.scripts.GUARD_PIECE`): what a refused guard or a watched key changed
between the guard and EXEC leaves behind (nothing), and that such a piece is redone once."""

from __future__ import annotations

import numpy as np

from embgeom.store import keys as K
from embgeom.store.checkpoints import Checkpointer
from embgeom.store.piece_writes import PieceWriter
from embgeom.store.shards import pieces_of
from tests.test_store import (assert_matches, checkpoint, held_jobs, make_conf, points_window,
                              r, reference)

__all__ = ["r"]  # the fixture, used by name


class TouchedAfterGuard(PieceWriter):
    """Between the guard and MULTI of its first ``count`` pieces, renews the part's lock
    lease (PEXPIRE: the value stays ours, the watched key is modified), as another client's
    command landing there would: the guard answers 1, EXEC must write nothing."""

    def __init__(self, *args, count, lock_ms, **kwargs):
        super().__init__(*args, **kwargs)
        self.count, self.lock_ms = count, lock_ms

    def _piece_commands(self, keys, *args, **kwargs):
        out = super()._piece_commands(keys, *args, **kwargs)
        if self.count > 0:
            self.count -= 1
            out.insert(2, ("PEXPIRE", keys.lock, self.lock_ms))
        return out


def test_a_piece_whose_watched_key_changed_after_its_guard_is_aborted_and_redone_once(r):
    pair = K.PairKeys("touched", "m")
    conf = make_conf(r, pair)
    rng = np.random.default_rng(11)
    keys = rng.integers(0, 40, size=150)
    x, tok, lay = points_window(rng, keys)
    cpr = Checkpointer(r, "w")
    cpr.shards.pieces = TouchedAfterGuard(r, count=3, lock_ms=cpr.shards.lock_ms)
    _, out = checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), cpr=cpr)
    assert out.status == "completed"
    total = len(pieces_of(tok.ids, conf, 3))
    # Had an aborted EXEC written its piece (and marker), the redo would have skipped it.
    # (A part's later pieces are refused too: their guards expect the earlier markers.)
    assert out.shards.lost >= 3 and out.shards.pieces == total and out.shards.pieces_skipped == 0
    assert_matches(r, pair, reference(keys, x))


class LockTakenBeforeWrite(PieceWriter):
    """Before its first write, another writer takes the first part's lock (its lease 300 ms):
    every piece of that part is refused (0) by its guard, the last one included; the part's
    records must be untouched. The part is applied in a later round, once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = None

    def write(self, parts, cp, fence, checked, writes, stats):
        if self.seen is None:
            writes = list(writes)  # (part, its pieces' writes), see ShardWriter._merge
            part, first = writes[0]
            live = [c for _, c in first["calls"] if c is not None]
            keys = parts.shard(*part)
            self.r.set(keys.lock, "another-writer", px=300)
            finished = super().write(parts, cp, fence, checked, writes, stats)
            self.seen = {"part": part, "live": len(live), "finished": finished,
                         "rec": self.r.hlen(keys.rec), "applied": self.r.hget(keys.applied, cp)}
            return finished
        return super().write(parts, cp, fence, checked, writes, stats)


def test_pieces_refused_by_their_guard_write_nothing_not_even_before_the_last(r):
    pair = K.PairKeys("taken", "m")
    conf = make_conf(r, pair, shards=2)
    rng = np.random.default_rng(12)
    keys = rng.integers(0, 40, size=150)
    x, tok, lay = points_window(rng, keys)
    cpr = Checkpointer(r, "w")
    cpr.shards.pieces = LockTakenBeforeWrite(r)
    cpr.shards.group_bytes = 1  # one part per round
    _, out = checkpoint(r, pair, conf, tok, lay, held_jobs(r, pair, 1), cpr=cpr)
    seen = cpr.shards.pieces.seen
    assert seen["live"] >= 3  # several pieces: the ones before the last are refused too
    assert seen["finished"] == [] and seen["rec"] == 0 and seen["applied"] is None
    assert out.status == "completed" and out.shards.lost >= seen["live"]
    assert out.shards.pieces == len(pieces_of(tok.ids, conf, 3))
    assert_matches(r, pair, reference(keys, x))
