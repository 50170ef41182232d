"""One thread's view of the backward's row tiles: where its cells are (global memory or a ring slot)
and the copies it issues.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute


@dataclass(frozen=True)
class ThreadTiles:
    """What a thread needs to find its cells of any row tile, and its two copies, predicated on the
    columns when the tiles overrun H."""

    thr: object
    tiler: tuple
    rank: object
    row_in_cta: object
    copy_act: object
    async_copy: object

    def of(self, m, tile):
        """This thread's cells of row tile ``tile`` of ``m`` (a (rows, H) tensor)."""
        return self.thr.partition_S(cute.local_tile(m, self.tiler, (tile, self.rank)))

    def in_smem(self, s, ring_slot):
        """This thread's cells of one slot of a shared-memory tile."""
        return self.thr.partition_D(s[None, None, ring_slot])

    def read(self, sources, fragments):
        """Copy this thread's cells of each source (the ring, or global memory) into its registers."""
        for source, fragment in zip(sources, fragments):
            self.copy_act(source, fragment)


@cute.jit
def issue_row_tile(tt: ThreadTiles, tile, ring_slot, sources, ring_tiles):
    """Issue the cp.async copies of row tile ``tile`` of each source into ``ring_slot``, one commit group."""
    for m, sT in zip(sources, ring_tiles):
        tt.async_copy(tt.of(m, tile), tt.in_smem(sT, ring_slot))
