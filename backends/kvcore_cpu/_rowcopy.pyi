"""Native one-pass row copies (``_rowcopy.c``); see ``copy_rows``."""

import numpy as np
import numpy.typing as npt

def copy_rows(
    src: npt.NDArray[np.uint8],
    dst: npt.NDArray[np.uint8],
    src_rows: npt.NDArray[np.int64],
    dst_rows: npt.NDArray[np.int64],
    /,
    *,
    stream: bool = False,
) -> None:
    """Copy row ``src_rows[i]`` of ``src`` to row ``dst_rows[i]`` of ``dst`` for every ``i``, with the GIL
    released. ``src`` and ``dst``: non-overlapping 2-D uint8 buffers, rows of one length, contiguous within
    a row; the row lists: 1-D int64 of one length, every index checked first (``IndexError`` names the
    first bad one; ``TypeError``/``ValueError`` a buffer of the wrong kind). ``stream`` writes with
    non-temporal stores."""
