"""A progress bar over the layers a worker loads, on stderr when that is a terminal (a large
checkpoint takes minutes; `siding launch` shows nothing else meanwhile)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm


def layers(layer_start: int, layer_end: int) -> Iterable[int]:
    """range(layer_start, layer_end), counted on a bar of its own line per worker."""
    n = layer_end - layer_start
    return tqdm(range(layer_start, layer_end), desc=f"loading layers {layer_start}-{layer_end - 1}",
                unit="layer", leave=False, disable=not sys.stderr.isatty() or n <= 0,
                position=layer_start // max(n, 1), dynamic_ncols=True)
