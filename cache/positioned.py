"""A layer's cache inside a decode step compiled whole: positions are arrays, not Python ints.

``mx.compile`` bakes Python ints into the trace, so a step that wrote at ``cache.offset`` would be
traced anew every token. Here the host asks each owning cache for its next ``DecodeRun``
(``AttentionCache.decode_run``: room made, row and read run chosen, all outside the compiled
function), and inside the function a ``PositionedCache`` stands in for it: it writes the new key
and value at the row given as an array (``mx.slice_update``), reads a fixed-length run of rows from
a start given as an array (``mx.slice``) with the mask ``masks.decode_run`` builds from them, and
records the read for KV-shared views, exactly like the ``decode`` read of the cache it stands for.
The host then hands the written planes back (``AttentionCache.commit_decode``). One trace serves
every step while the buffers keep their shapes (a full layer's buffer grows every ``step``
positions; a sliding layer's reaches its fixed capacity once).
"""

from __future__ import annotations

import mlx.core as mx

from . import masks
from .attention import check_qkv, check_scale
from .base import Attended, AttentionCache, _geometry
from .codecs import Planes
from .reads import only_read
from .spec import CacheSpec


@only_read("decode", "a compiled decode step makes only decode reads (one position per row)")
class PositionedCache(AttentionCache):
    """Stands in for one owning cache in a compiled decode step; only the ``decode`` read exists.

    ``spec`` is the real cache's (``check_caches`` sees the same layer types), ``codec`` its codec,
    ``keys``/``values`` its planes (compiled-function inputs), ``offset`` the absolute position of
    the new query and ``write_row``/``start`` the rows of its ``DecodeRun`` (scalar int32 arrays);
    ``size`` and ``masked`` are the run's trace-time constants.
    """

    def __init__(self, spec: CacheSpec, codec, keys: Planes, values: Planes, offset: mx.array,
                 write_row: mx.array, start: mx.array, size: int, masked: bool):  # fmt: skip
        super().__init__(codec)
        self.kind, self.sliding_window, self._spec = spec.kind, spec.window, spec
        self.keys, self.values = tuple(keys), tuple(values)
        self.offset = offset
        self._write_row, self._start, self._size, self._masked = write_row, start, size, masked

    def spec(self, index_of=None) -> CacheSpec:
        return self._spec

    def decode(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
        """The real cache's ``decode`` read: the new position written at ``write_row``, the query
        attending the run of ``size`` rows from ``start`` (rows past the new one masked)."""
        check_qkv("decode", q, k, v)
        if q.shape[2] != 1:
            raise ValueError(f"decode: takes exactly L=1 new position, got L={q.shape[2]}")
        scale = check_scale("decode", scale)
        self.codec.check("decode", k, v)
        row = self._write_row.reshape(1)
        self.keys = tuple(mx.slice_update(p, x, row, axes=(2,)) for p, x in zip(self.keys, self.codec.pack(k)))
        self.values = tuple(mx.slice_update(p, x, row, axes=(2,)) for p, x in zip(self.values, self.codec.pack(v)))
        mask = masks.decode_run(self._start, self._size, self._write_row) if self._masked else None
        run = (self._start, self._size)
        self._last = Attended("decode", 1, self.offset, self.keys, self.values, mask, _geometry(k, v), run)
        return self.codec.attend_run(q, self.keys, self.values, *run, scale, mask)

    def can_trim(self, n: int) -> bool:
        return False

