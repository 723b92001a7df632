"""Rows of a (N, V) tensor in tiles that fit a byte budget, for per-pass work over positions x
vocabulary (a sampler's softmax, draw, argmax, entropy): its transient memory is then a few tiles,
whatever the vocabulary, canvas and batch, where whole-tensor work would take several (N, V) copies
(at a 262,144-token vocabulary and 256 positions, 268 MB each in float32).

Row-wise work gives the same bits in tiles as whole, with one exception a tile avoids: a tile of one
row, which torch splits across its threads, so its reductions (a sum, a logsumexp) may round
differently. A tile is never a single row unless the whole is one row (the last tile takes a
lone remainder row)."""
from collections.abc import Callable

import torch

# One tile of the values, e.g. 2 rows of a 262,144-token vocabulary in float32: small enough that a
# tile and the few temporaries a sampler makes of it stay in a CPU's last-level cache (tiles of 8 MiB
# ran the DiffusionGemma sampler's softmax, logsumexp and subtraction 3-10x slower on a 32 MiB L3).
TILE_BYTES = 2 << 20
# A matmul over the values (DiffusionGemma's soft embedding): 64 rows at that vocabulary, since a
# matmul of a few rows may take another BLAS kernel, which rounds otherwise.
MATMUL_TILE_BYTES = 64 << 20


def row_tiles(num_rows: int, width: int, element_bytes: int = 4, for_matmul: bool = False) -> list[slice]:
    """Consecutive slices covering range(num_rows), each of at least 2 rows (unless num_rows is 1) and
    at most max(2, budget // (width * element_bytes)) + 1, the budget TILE_BYTES (MATMUL_TILE_BYTES
    `for_matmul`)."""
    budget = MATMUL_TILE_BYTES if for_matmul else TILE_BYTES
    size = max(2, budget // max(1, width * element_bytes))
    starts = list(range(0, num_rows, size))
    if len(starts) > 1 and num_rows - starts[-1] == 1:
        starts.pop()  # the lone last row joins the tile before it
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], num_rows])]


def tiled(fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]], values: torch.Tensor,
          for_matmul: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`fn` over the rows of values (..., V) in row tiles, in row order (a random draw in `fn` then
    takes the generator's stream as one call over all rows would): its outputs, one tensor or a tuple,
    each (rows, ...) per tile, joined and shaped (..., ...) as values' leading dimensions."""
    flat = values.reshape(-1, values.shape[-1])
    tiles = row_tiles(flat.shape[0], flat.shape[1], flat.element_size(), for_matmul)
    if len(tiles) == 1:
        return fn(values)
    parts = [fn(flat[rows]) for rows in tiles]
    lead = values.shape[:-1]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column).view(*lead, *column[0].shape[1:]) for column in zip(*parts))
    return torch.cat(parts).view(*lead, *parts[0].shape[1:])
