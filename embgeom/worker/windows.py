"""The open window, and the policy over windows: when one is due for a checkpoint, and at
what size a new one starts."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from embgeom.compute.reduce import PRECISIONS
from embgeom.compute.window import WindowAccumulator
from embgeom.settings import Settings
from embgeom.store import keys as K
from embgeom.store.conf import PairConf


@dataclass
class Window:
    """The jobs of one pair merged since its last checkpoint."""

    pair: K.PairKeys
    stream: str
    conf: PairConf
    engine: Optional[object]                          # both None once the window closed:
    acc: Optional[WindowAccumulator]                  # device memory and model let go
    held: list = field(default_factory=list)          # Held
    deliveries: list = field(default_factory=list)    # Delivery, same order
    names: dict = field(default_factory=dict)         # hashed word key -> name
    started: float = field(default_factory=time.monotonic)


class WindowPolicy:
    """When a window is due, and how many rows a new one starts with."""

    MAX_WINDOW_SHAPES = 32
    FIRST_WINDOW_ROWS = 1024
    FIRST_WINDOW_BYTES = 64 << 20  # a 17 x 2048 model's 1024 rows would be 570 MB

    def __init__(self, settings: Settings):
        self.settings = settings
        # Rows each window shape (L, d, self-similarity) last reached: a new window of that
        # shape starts there (growing by doubling copies everything), and no other does.
        self._window_rows: OrderedDict[tuple, int] = OrderedDict()

    def due(self, w: Optional[Window], applier_busy: bool, last_apply_seconds: float) -> bool:
        """The window's budget is spent. While the previous checkpoint is still being
        applied, the window keeps growing (up to its byte budget, or four times its time
        budget): Redis is the bottleneck then, and a larger window writes fewer bytes per
        token (Heaps' law)."""
        s = self.settings
        if w is None:
            return False
        if w.acc.nbytes >= s.checkpoint_bytes or w.acc.tokens >= s.checkpoint_tokens:
            return True
        age = time.monotonic() - w.started
        # At least checkpoint_seconds, and long enough that the last checkpoint took at
        # most checkpoint_max_share of the window's time.
        due = max(s.checkpoint_seconds, last_apply_seconds / s.checkpoint_max_share)
        if applier_busy:
            due = max(due, 4 * s.checkpoint_seconds)
        return age >= due

    def accumulator(self, conf: PairConf, engine) -> WindowAccumulator:
        """A new window: at the rows its shape reached last time (the first time,
        :attr:`FIRST_WINDOW_ROWS` within :attr:`FIRST_WINDOW_BYTES`), never more than the
        byte budget holds."""
        device = getattr(getattr(engine, "loaded", None), "device", "cpu")
        shape = (conf.L, conf.d, conf.self_similarity)
        max_rows = WindowAccumulator.rows_within(conf.L, conf.d, conf.self_similarity,
                                                 self.settings.checkpoint_bytes)
        first = min(self.FIRST_WINDOW_ROWS, WindowAccumulator.rows_within(
            conf.L, conf.d, conf.self_similarity, self.FIRST_WINDOW_BYTES))
        rows = self._window_rows.get(shape, first)
        return WindowAccumulator(conf.L, conf.d, conf.self_similarity, device,
                                 capacity=min(rows, max_rows), max_capacity=max_rows,
                                 cross_layer=conf.cross_layer,
                                 shift_dtype=PRECISIONS[getattr(engine, "precision", "fp32")])

    def remember(self, acc: WindowAccumulator) -> None:
        """Note the rows a closing window reached, for the next one of its shape (a
        bounded LRU of shapes)."""
        shape = (acc.num_layers, acc.dim, acc.self_similarity)
        self._window_rows[shape] = max(len(acc), self._window_rows.get(shape, 0))
        self._window_rows.move_to_end(shape)
        while len(self._window_rows) > self.MAX_WINDOW_SHAPES:
            self._window_rows.popitem(last=False)
