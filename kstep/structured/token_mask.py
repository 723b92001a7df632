"""Packed token masks: llguidance's layout (llguidance/torch.py), one int32 word per 32 token ids, token
t allowed when bit t % 32 of word t // 32 is set. A decoder batch's masks are filled by llguidance's
parallel filler into one (B, W) array (`fill`), moved to the logits' device once and applied there
(`apply`); a walk reads single bits of it on the host (`has`, `nth`) without unpacking V bits.

One executor per process, with few threads: a mask takes microseconds to a few milliseconds, and
the filler runs between passes, while the model's own threads wait. No grammar state here: what a
row's mask holds (a closed row's stop token, a released row's every token) is matcher.py's."""
import functools
import os

import llguidance
import numpy as np
import torch

WORD_BITS = 32
MAX_FILL_THREADS = 4


def num_words(vocab_size: int) -> int:
    """W: the int32 words of one packed mask of `vocab_size` ids."""
    return -(-vocab_size // WORD_BITS)


@functools.cache
def executor() -> llguidance.LLExecutor:
    """llguidance's parallel mask filler, one per process (module note)."""
    return llguidance.LLExecutor(num_threads=max(1, min(MAX_FILL_THREADS, os.cpu_count() or 1)))


def fill(matchers: list[tuple[llguidance.LLMatcher, int]], out: np.ndarray) -> None:
    """Each matcher's next-token mask into its row of `out` (B, W) int32, all at once (module note)."""
    if out.dtype != np.int32 or not out.flags.c_contiguous:
        raise RuntimeError("internal: a packed mask batch is a C-contiguous int32 array")
    executor().unsafe_compute_mask_ptr(matchers, out.ctypes.data, out.shape[1] * 4, out.shape[0])


def fill_one(matcher: llguidance.LLMatcher, width: int) -> np.ndarray:
    """(W,) int32: one matcher's next-token mask, `width` words."""
    out = np.zeros(width, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
    return out


def only(token_ids: list[int], width: int) -> np.ndarray:
    """(W,) int32 with exactly the bits of `token_ids` set."""
    return allow(np.zeros(width, dtype=np.int32), token_ids)


def every(vocab_size: int, width: int) -> np.ndarray:
    """(W,) int32 with every id below `vocab_size` set."""
    return trim(np.full(width, -1, dtype=np.int32), vocab_size)


def allow(words: np.ndarray, token_ids: list[int]) -> np.ndarray:
    """`words` with the bits of `token_ids` set too (in place)."""
    view = words.view(np.uint32)
    for t in token_ids:
        view[t // WORD_BITS] |= np.uint32(1 << (t % WORD_BITS))
    return words


def trim(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """`words` (..., W) with the bits of ids at or past `vocab_size` cleared (in place): never allowed."""
    view, full = words.view(np.uint32), vocab_size // WORD_BITS
    if full < view.shape[-1]:
        view[..., full] &= np.uint32((1 << (vocab_size % WORD_BITS)) - 1)
        view[..., full + 1:] = 0
    return words


def has(words: np.ndarray, token: int) -> bool:
    """Whether `token` is allowed: one bit, read on the host."""
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def count(words: np.ndarray) -> int:
    """How many tokens are allowed."""
    return int(np.bitwise_count(words.view(np.uint32)).sum())


def nth(words: np.ndarray, r: int) -> int:
    """The id of the r-th allowed token (0-based, ascending ids; r < count(words))."""
    counts = np.bitwise_count(words.view(np.uint32)).astype(np.int64)
    word = int(np.searchsorted(np.cumsum(counts), r, side="right"))
    r -= int(counts[:word].sum())
    bits = int(words.view(np.uint32)[word])
    for _ in range(r):  # drop the r lowest set bits
        bits &= bits - 1
    return word * WORD_BITS + (bits & -bits).bit_length() - 1


def unpack(words: np.ndarray, width: int) -> np.ndarray:
    """(..., W) packed -> (..., width) bool, one byte per id (ids past 32 W: False)."""
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little").view(bool)
    if bits.shape[-1] < width:
        bits = np.concatenate([bits, np.zeros((*bits.shape[:-1], width - bits.shape[-1]), dtype=bool)], -1)
    return bits[..., :width]


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_on(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """(N, W) int32 packed -> (N, width) bool on its device: on the CPU by numpy's unpacker, elsewhere
    by `unpack_bytes` (32 times fewer bytes moved to the device than an unpacked mask)."""
    return torch.from_numpy(unpack(bitmask.numpy(), width)) if bitmask.is_cpu else unpack_bytes(bitmask, width)


def unpack_bytes(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """`unpack_on` in torch ops, a byte at a time (any device: the GPU's way)."""
    if bitmask.device not in _SHIFTS:
        _SHIFTS[bitmask.device] = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = ((bitmask.view(torch.uint8)[..., None] >> _SHIFTS[bitmask.device]) & 1).view(torch.bool)  # (N, 4W, 8)
    bits = bits.reshape(bitmask.shape[0], -1)[:, :width]
    return bits if bits.shape[1] == width else torch.cat([bits, bits.new_zeros(len(bits), width - bits.shape[1])], 1)


def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits (N, V) with every token its row's packed mask `bitmask` (N, W) int32, on the logits'
    device, refuses at -inf (ids past its 32 W bits too), in the rows `rows` (N,) bool (None: all);
    a new tensor."""
    N, V = logits.shape
    if rows is not None:  # a row outside keeps every token: all its bits set (a (N, W) op, not (N, V))
        bitmask = torch.where(rows[:, None], bitmask, -1)
    allowed = unpack_on(bitmask, V)  # (N, V)
    if rows is not None and V > WORD_BITS * bitmask.shape[1]:  # a padded head, past the mask: refused in `rows`
        allowed = torch.cat([allowed[:, :WORD_BITS * bitmask.shape[1]],
                             ~rows[:, None].expand(N, V - WORD_BITS * bitmask.shape[1])], 1)
    return torch.where(allowed, logits, float("-inf"))
