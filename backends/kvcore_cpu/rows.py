"""Where a block pair's bytes sit: engine and host block ids turned into row indices.

Every copy is made of rows of ``plane_bytes`` (one block of one plane). A ``Route`` pairs an engine row
view with the matching rows of host blocks: a single route covers every plane when the planes share one
storage (so one indexed copy moves a block of every layer), otherwise there is one route per plane.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from attrs import frozen

from kvcore.errors import InvalidSpecError
from kvcore.model.head_runs import Run
from kvcore_cpu.engine_kv import EngineKV

__all__ = ["IntArray", "Route", "head_routes", "routes"]

IntArray = npt.NDArray[np.int64]


@frozen(eq=False)
class Route:
    """Engine rows ``engine`` and the host rows they pair with.

    ``plane`` is ``None`` when the route covers every plane (a host block's rows are ``h * planes + q``),
    else the one plane it covers (a host block's row is ``h`` of that plane's column). Engine block ``b``'s
    rows are ``b * engine_step + engine_base``.
    """

    engine: torch.Tensor
    engine_base: IntArray
    plane: int | None
    planes: int
    engine_step: int = 1

    @property
    def whole_blocks(self) -> bool:
        """Whether an engine block's rows are one run laid out as the host block's, and block ``b + 1``'s
        follow block ``b``'s: a run of consecutive blocks is then one copy on both sides."""
        width = len(self.engine_base)
        consecutive = bool((np.diff(self.engine_base) == 1).all())
        return consecutive and self.engine_step == width and (self.plane is None or self.planes == 1)

    def host_view(self, blocks: torch.Tensor) -> torch.Tensor:
        """The rows this route copies to or from in ``blocks`` (contiguous ``[k, host_block_bytes]``)."""
        row = int(self.engine.shape[1])
        if self.plane is None:
            return blocks.view(-1, row)
        return blocks.view(blocks.shape[0], self.planes, row)[:, self.plane]

    def engine_rows(self, engine_ids: IntArray) -> IntArray:
        """Engine rows of every (block, plane), block-major."""
        rows: IntArray = (engine_ids[:, None] * self.engine_step + self.engine_base[None, :]).ravel()
        return rows

    def host_rows(self, host_ids: IntArray) -> IntArray:
        """``host_view`` rows of every (block, plane), in the order of ``engine_rows``."""
        width = len(self.engine_base)
        rows: IntArray = (host_ids[:, None] * width + np.arange(width, dtype=np.int64)[None, :]).ravel()
        return rows


def routes(engine: EngineKV) -> tuple[Route, ...]:
    """One route over shared rows when the engine has them, else one route per plane."""
    planes = engine.planes
    if engine.shared is not None:
        base = np.asarray(engine.shared.plane_rows, dtype=np.int64)
        return (Route(engine.shared.rows, base, None, len(planes), engine.shared.block_step),)
    zero = np.zeros(1, dtype=np.int64)
    return tuple(Route(plane, zero, q, len(planes)) for q, plane in enumerate(planes))


def head_routes(engine: EngineKV, runs: Sequence[Run]) -> tuple[Route, ...]:
    """One route per run of a KV head in a host block (``kvcore.model.head_runs``): the run's bytes of
    every engine block, paired with row ``j`` of a head block, whose rows are the head's runs in order.

    Raises ``InvalidSpecError`` for runs of different lengths or a run that crosses a plane."""
    if not runs or len({length for _, length in runs}) != 1:
        raise InvalidSpecError(f"runs: got {list(runs)!r}, expected runs of one length")
    out = []
    for j, (offset, length) in enumerate(runs):
        plane_index, start = divmod(offset, engine.plane_bytes)
        if plane_index >= len(engine.planes) or start + length > engine.plane_bytes:
            raise InvalidSpecError(
                f"runs[{j}]: ({offset}, {length}) crosses a plane of {engine.plane_bytes} bytes"
            )
        plane = engine.planes[plane_index]
        view = torch.as_strided(
            plane, (int(plane.shape[0]), length), (plane.stride(0), 1), plane.storage_offset() + start
        )
        out.append(Route(view, np.zeros(1, dtype=np.int64), j, len(runs)))
    return tuple(out)
