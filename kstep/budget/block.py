"""What a block-diffusion decoding runs at worst, pass by pass (decoding/block_diffusion.py,
block_cache.py, token_editing.py), and the coarser settings a time budget may choose among
(planner.py picks one; this module only counts).

A decoding of N tokens after a prompt of P covers the blocks P // bs .. (P + N - 1) // bs, the last
one whole (its positions past N are decoded too, as the references decode whole blocks). At worst
(no confidence above the threshold, and the positions within N unmasked last; with sub-blocks, the
last block's from the one holding position P + N - 1 on are not needed):
- a prefill when the prompt holds a whole block (P >= bs), one pass over the prompt; an unshifted
  model with fused commits (SDAR, LLaDA2) runs its first block in it too: that block's first pass;
- in each block, one pass per mask, or with `steps` the schedule's count per pass (`steps` passes
  for a whole block), and only inside the open sub-block (Fast-dLLM v2). A shifted model (Fast-dLLM
  v2) has each block's first token from the commit (the first block's from the prefill when the
  prompt ends on a block boundary), and a fused commit's token counts toward that pass's minimum;
- token editing (LLaDA2.1): after a block's last mask, max_post_steps more passes that keep editing;
- a commit for every block but the last (a block that ended is final, and so is the row): a pass of
  its own over the finished block, or with fused_commit none: the next block's first pass runs
  [finished; next], twice as wide. (Editing that converges needs no commit: not the worst case.)
A pass of block j attends to (j + 1) * bs positions. With Fast-dLLM v2's block cache (cache "dual")
the passes inside a sub-block run only the sub-block; they are costed as whole-block passes (its
worst case: every sub-block's first position may be the last unmasked, and then each pass runs whole).
Nemotron-Labs-Diffusion's blocks (decoding/causal_context.py) follow the prompt instead: `causal_context_run`.
"""
from dataclasses import dataclass

from kstep.params import GenerationParams
from kstep.registry import BlockRules


@dataclass(frozen=True, slots=True)
class BlockRun:
    """A decoding's passes at worst: how many, and how many of each (width, attended)."""
    passes: int
    groups: tuple[tuple[int, int, int], ...]  # (tokens, attended, count)


def transfer_counts(block: int, steps: int) -> list[int]:
    """Tokens per pass of a block split evenly over `steps` passes, the remainder first
    (decoding/schedule.py's num_transfer_tokens, for one block)."""
    return [block // steps + (i < block % steps) for i in range(steps)]


def mask_passes(masks: list[int], schedule: list[int] | None, already: int = 0) -> int:
    """Passes that unmask `masks` (per sub-block, in order: a pass unmasks only in the first one
    with a mask left) when each unmasks its minimum: the schedule's count (1 without one), less
    `already` in the first pass (a fused commit's first token)."""
    left, passes = list(masks), 0
    while any(left):
        count = 1 if schedule is None else schedule[min(passes, len(schedule) - 1)]
        if passes == 0:
            count = max(0, count - already)
        sub = next(i for i, m in enumerate(left) if m)
        left[sub] -= min(count, left[sub])
        passes += 1
    return passes


def worst_run(params: GenerationParams, prompt_len: int, rules: BlockRules, max_positions: int | None = None
              ) -> BlockRun:
    """The passes a block decoding under resolved `params` runs at worst (module note), by its
    family's `rules`; `max_positions`: whether commits can be fused (they need a block of room)."""
    if rules.has_causal_context:
        return causal_context_run(params, prompt_len)
    P, N, bs = prompt_len, params.max_tokens, params.block_length
    sub = params.sub_block_length or bs
    shifted = rules.is_shifted
    fused = params.fused_commit and (max_positions is None or P + N + 2 * bs <= max_positions)
    editing = params.editing_threshold is not None
    steps = params.steps
    if rules.steps_capped and not editing:
        steps = min(steps or bs, N)
    schedule = None if steps is None else transfer_counts(bs, steps)
    post = (params.max_post_steps or 0) if editing else 0
    first, last = P // bs, (P + N - 1) // bs
    has_prefill = P >= bs
    fused_prefill = fused and not shifted and has_prefill
    groups: dict[tuple[int, int], int] = {}

    def add(tokens: int, attended: int, count: int = 1) -> None:
        if count > 0:
            groups[tokens, attended] = groups.get((tokens, attended), 0) + count

    if has_prefill:
        add(P + bs, P + bs) if fused_prefill else add(P, P)
    for j in range(first, last + 1):
        start, attended = j * bs, (j + 1) * bs
        given = shifted and start >= P and (j > first or has_prefill)  # its first token is written already
        # (the last block's sub-blocks after the one holding position P + N - 1 are never needed: its
        # row is final once every position up to there is, and sub-blocks are unmasked in order)
        masks = [sum(1 for pos in range(lo, lo + sub) if pos >= P and not (given and pos == start))
                 for lo in range(start, start + bs, sub) if lo < P + N or editing]
        passes = mask_passes(masks, schedule, int(shifted and fused and j > first)) + post
        if j == first and fused_prefill:
            passes -= 1  # its first pass was the prefill
        elif j > first and fused:
            add(2 * bs, attended)  # the first pass carries the last block's commit
            passes -= 1
        add(bs, attended, passes)
        if j < last and not fused:
            add(bs, attended)  # the commit pass of its own
    return BlockRun(sum(groups.values()), tuple((t, a, c) for (t, a), c in groups.items()))


def causal_context_run(params: GenerationParams, prompt_len: int) -> BlockRun:
    """Nemotron's block diffusion at worst: a causal prefill over the prompt; then blocks of bs after
    it, each with its first token given (the prefill's, or the commit's before it) and its bs - 1
    masks unmasked one per pass, or the schedule's count (`steps`), the positions before max_tokens
    last; a causal commit pass over every block but the last. Block j's passes attend to P + (j + 1) bs."""
    P, N, bs = prompt_len, params.max_tokens, params.block_length
    schedule = None if params.steps is None else transfer_counts(bs - 1, params.steps)
    blocks, passes = -(-N // bs), mask_passes([bs - 1], schedule)
    groups = [(P, P, 1)] + [(bs, P + (j + 1) * bs, passes + (j < blocks - 1)) for j in range(blocks)]
    return BlockRun(sum(c for _, _, c in groups), tuple(groups))


def coarser_settings(params: GenerationParams) -> list[tuple[dict, ...]]:
    """Changes to resolved `params` that run fewer passes per block, finest first; each a tuple of
    alternatives (the first the family takes wins). Without editing: a pass cap (`steps`, the
    threshold kept: every mask above it, at least the schedule's count) from bs down to 1, keeping
    sub-blocks while each gets a pass. With editing: fewer post steps (max_post_steps down to 0),
    then a pass cap with editing (when the family takes both) or without it."""
    bs = params.block_length
    sub = params.sub_block_length or bs
    threshold = params.policy.value if params.policy is not None and params.policy.kind == "threshold" else None

    def capped(k: int, **more) -> dict:
        return {"steps": k, "threshold": threshold, "sub_block_length": sub if k >= bs // sub else bs, **more}

    if params.editing_threshold is None:
        return [(capped(k),) for k in range(bs, 0, -1)]
    fewer_post = [({"max_post_steps": m},) for m in range((params.max_post_steps or 0) - 1, -1, -1)]
    return fewer_post + [(capped(k, max_post_steps=0), capped(k, editing_threshold=None, max_post_steps=None))
                         for k in range(bs, 0, -1)]
