"""One draw per row of categorical probabilities, equal to `torch.multinomial(probs, 1, generator=g)`
bit for bit, and leaving `g` in the same state, at a fraction of its cost on the CPU.

Why: at a 262,144-token vocabulary DiffusionGemma's sampler draws from every canvas position's whole
distribution each pass (transformers' order, which a seeded run must reproduce), and multinomial's
`exponential_` (a logarithm per element) was its largest part.

How torch draws one sample per row on the CPU (2.13): q = exponential_(), one 64-bit word per element
in row-major order, q = dtype(-log1p(-u)) where u is the float64 uniform `uniform_` makes of the same
word; the draw is argmax(p / q), the first index on ties. Here u comes from `uniform_` (the same
words, the same state after), and since -log1p(-u) >= u, p / u bounds every ratio from above: only
the few tokens whose bound reaches the best exact ratio found (about one a row) get their exact
ratio, computed as torch's kernel computes it. Where those facts may not hold, torch's own draw:
another device, float16, a u of 0 (a ratio of infinity), or a torch whose draw differs from this
one's, which `is_exact` checks once per process on random cases.

For float32 probabilities the words come from kstep's CPU kernels where they are built (cpu_draw.c:
torch's Mersenne Twister continued on its state's bytes, the bounds and each row's best taken in
the same loop), about four times faster than `uniform_`'s element-at-a-time loop and without a
float64 copy of the probabilities; `native` checks once per process that it draws as torch does,
ids and generator state, and torch's `uniform_` serves otherwise."""
import functools
import math

import torch

from kstep.layers import cpu_kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
STATE_BYTES = 5056  # torch's CPU generator state (its THGeneratorStateNew), which cpu_draw.c reads


def draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(N, V) probabilities (non-negative, each row with mass) -> (N,) int64 ids, as
    torch.multinomial(probs, 1, generator=generator)[:, 0]."""
    if probs.device.type != "cpu" or probs.dtype not in DTYPES or not is_exact():
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return _draw(probs, generator, native())


def _draw(probs: torch.Tensor, generator: torch.Generator | None, lib=None) -> torch.Tensor:
    """The draw: whole in `lib` (kstep's CPU kernels, cpu_draw.c) for float32, else on torch's uniform_."""
    source = generator if generator is not None else torch.default_generator
    state = source.get_state()
    if lib is not None and probs.dtype == torch.float32 and probs.is_contiguous() and state.numel() == STATE_BYTES:
        after, drawn = state.clone(), torch.empty(probs.shape[0], dtype=torch.long)
        if lib.kstep_draw(after.data_ptr(), probs.data_ptr(), *probs.shape, drawn.data_ptr()) == 0:
            source.set_state(after)
            return drawn
        return torch.multinomial(probs, 1, generator=source)[:, 0]  # a u of 0, or a state it cannot read: torch's
    u = torch.empty(probs.shape, dtype=torch.float64).uniform_(generator=source)
    if bool((u == 0).any()):  # p / 0: replay torch's own draw from the same state
        source.set_state(state)
        return torch.multinomial(probs, 1, generator=source)[:, 0]
    bound = probs / u  # float64, >= p / q for every token
    rows = torch.arange(probs.shape[0])
    guess = bound.argmax(-1)
    floor = _ratios(probs[rows, guess], u[rows, guess])  # the exact ratio of a likely winner
    # the bound holds in exact arithmetic; the margin covers the rounding of q and of each division
    margin = 1 - 4 * torch.finfo(probs.dtype).eps
    row, col = (bound >= (floor.double() * margin)[:, None]).nonzero(as_tuple=True)
    ratios = _ratios(probs[row, col], u[row, col])
    best = torch.full((probs.shape[0],), -1.0, dtype=probs.dtype).scatter_reduce(0, row, ratios, "amax")
    wins = ratios == best[row]
    return torch.full((probs.shape[0],), probs.shape[1], dtype=torch.long).scatter_reduce(0, row[wins], col[wins],
                                                                                          "amin")


@functools.cache
def native():
    """kstep's CPU kernels (cpu_draw.c) where they are built and draw as torch does (checked once per
    process, as `is_exact`), else None."""
    lib = cpu_kernels.library()
    return lib if lib is not None and _equals_multinomial(lib) else None


def _ratios(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """p / q with q = dtype(-log1p(-u)), as torch's exponential_ and multinomial compute them (the C
    library's log1p, through Python's math module)."""
    q = torch.tensor([-math.log1p(-x) for x in u.tolist()], dtype=torch.float64).to(p.dtype)
    return p / q


@functools.cache
def is_exact() -> bool:
    """Whether `_draw` on torch's uniform_ equals this torch's multinomial on random cases."""
    return _equals_multinomial(None)


def _equals_multinomial(lib) -> bool:
    """Whether `_draw` (with `lib`'s stream, or torch's) equals this torch's multinomial on random cases
    (ties, zeros, peaked and flat rows, each dtype): ids and the generator's state after."""
    check = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for rows, width in ((7, 5), (33, 1000), (4, 70_000)):
            logits = torch.randn(rows, width, generator=check, dtype=torch.float64) * (1 + 9 * torch.rand(
                rows, 1, generator=check, dtype=torch.float64))
            logits[:, ::3] = float("-inf")
            logits[0, :] = 0.0  # a flat row: every ratio's bound is close
            probs = torch.softmax(logits, -1).to(dtype)
            probs[1, 1:4] = probs[1, 0]  # ties
            seed = int(torch.randint(0, 2**62, (1,), generator=check))
            mine, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            if not torch.equal(_draw(probs, mine, lib), torch.multinomial(probs, 1, generator=theirs)[:, 0]) \
                    or not torch.equal(mine.get_state(), theirs.get_state()):
                return False
    return True
