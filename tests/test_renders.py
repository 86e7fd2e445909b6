"""The renderer's answer while a collection changes (:meth:`embgeom.renders.Renderer.serve`).

Unit tests without Redis or matplotlib: a drawing is a function that blocks until the
test lets it finish, so each case decides which of "the current drawing" and "the
earlier one" is ready when the request's wait ends. The same policy over HTTP, with a
real worker changing the collection, is in tests/test_figures_api.py.
"""

from __future__ import annotations

import threading

import pytest

from embgeom.errors import NotFound, Overloaded
from embgeom.renders import RenderCache, Renderer, Rendered, _query

SCOPE = ("c", ("m",))
WHAT = ("report", "svg", None, 1, None)


def key(version: int, gen: int = 1) -> tuple:
    return SCOPE, ((gen, version),), WHAT


class Drawing:
    """``draw()`` for :meth:`Renderer.serve`: the page of ``version``, once released."""

    def __init__(self, version: int, gen: int = 1, released: bool = True):
        self.version, self.gen = version, gen
        self.release = threading.Event()
        if released:
            self.release.set()
        self.calls = 0

    def __call__(self):
        self.calls += 1
        assert self.release.wait(10)
        page = f"page of version {self.version}".encode() + (b" (remade)" if self.gen > 1 else b"")
        return Rendered(page, {"version": self.version}, None), ((self.gen, self.version, 0),)


def renderer(wait: float = 0.05, max_stale: float = 60.0) -> Renderer:
    return Renderer(RenderCache(1 << 20), pool=None, max_stale_seconds=max_stale, wait_seconds=wait)


def test_a_slow_drawing_is_answered_with_the_newest_drawn_marked_stale():
    r = renderer()
    first = r.serve(key(1), False, Drawing(1))
    assert (first.content, first.stale, first.hit) == (b"page of version 1", False, False)

    slow = Drawing(2, released=False)
    answer = r.serve(key(2), False, slow)
    assert answer.content == b"page of version 1" and answer.stale and answer.as_of == {"version": 1}

    slow.release.set()  # the drawing went on in the background and is kept for the next request
    for _ in range(200):
        if r.newest.get(_query(key(2)))[0] == ((1, 2),):
            break
        threading.Event().wait(0.01)
    again = r.serve(key(2), False, Drawing(99))
    assert again.content == b"page of version 2" and not again.stale
    assert slow.calls == 1


def test_a_drawing_done_within_the_wait_is_answered_fresh():
    r = renderer(wait=5.0)
    r.serve(key(1), False, Drawing(1))
    answer = r.serve(key(2), False, Drawing(2))
    assert answer.content == b"page of version 2" and not answer.stale


def test_fresh_waits_for_the_current_drawing():
    r = renderer()
    r.serve(key(1), False, Drawing(1))
    slow = Drawing(2, released=False)
    threading.Timer(0.3, slow.release.set).start()
    answer = r.serve(key(2), True, slow)
    assert answer.content == b"page of version 2" and not answer.stale


def test_no_earlier_drawing_of_another_generation_or_too_old_is_answered():
    r = renderer()
    r.serve(key(1), False, Drawing(1))
    slow = Drawing(1, gen=2, released=False)  # the collection was deleted and made again
    threading.Timer(0.3, slow.release.set).start()
    assert r.serve(key(1, gen=2), False, slow).content == b"page of version 1 (remade)"

    old = renderer(max_stale=0.0)  # 0: always the current drawing
    old.serve(key(1), False, Drawing(1))
    slow = Drawing(2, released=False)
    threading.Timer(0.3, slow.release.set).start()
    assert old.serve(key(2), False, slow).content == b"page of version 2"


def test_concurrent_stale_requests_start_one_background_drawing():
    r = renderer()
    r.serve(key(1), False, Drawing(1))
    slow = Drawing(2, released=False)
    answers = [r.serve(key(2), False, slow) for _ in range(5)]
    assert all(a.stale for a in answers) and slow.calls == 1
    slow.release.set()


def test_a_drawing_begun_for_an_earlier_version_is_marked_stale():
    """A request for version 3 while version 2's drawing runs in the background: it waits
    for that one (newer than the kept version 1) and gets it, marked stale."""
    r = renderer(wait=0.05)
    r.serve(key(1), False, Drawing(1))
    slow = Drawing(2, released=False)
    assert r.serve(key(2), False, slow).stale  # version 1, while 2 is drawn
    r.wait_seconds = 5.0
    threading.Timer(0.3, slow.release.set).start()
    answer = r.serve(key(3), False, Drawing(3))
    assert answer.content == b"page of version 2" and answer.stale


def test_a_drawing_that_fails_within_the_wait_is_reported():
    r = renderer(wait=5.0)
    r.serve(key(1), False, Drawing(1))

    def gone():
        raise NotFound("no such collection", "collection_not_found")

    with pytest.raises(NotFound):
        r.serve(key(2), False, gone)


def test_no_room_to_draw_is_answered_with_the_earlier_drawing():
    """The render queue full (429 overloaded) while an earlier drawing exists: that one."""
    r = renderer(wait=5.0)
    r.serve(key(1), False, Drawing(1))

    def full():
        raise Overloaded("32 drawings are in progress or waiting", reason="render_queue_full")

    answer = r.serve(key(2), False, full)
    assert answer.content == b"page of version 1" and answer.stale
    with pytest.raises(Overloaded):  # nothing drawn before: the 429 is the answer
        renderer().serve(key(2), False, full)


def test_an_older_drawing_ending_late_does_not_replace_a_newer_one():
    r = renderer()
    r.serve(key(3), False, Drawing(3))
    r._keep_newest(_query(key(1)), ((1, 1),), Rendered(b"page of version 1", {"version": 1}, None), 0.0)
    assert r.newest.get(_query(key(1)))[0] == ((1, 3),)
