"""The model runner: owns the model, allocates KV buffers, and runs every forward pass.

Decoders describe the pass they need (`ForwardPass`: tokens, positions, mask, cache window,
which positions need logits); they never touch the model. `execute` runs any number of such
passes, from different sequences, as one packed forward pass: the weights are read once for all of
them, which is what continuous batching buys. Attention stays per sequence, so a sequence's
logits do not depend on what it was batched with.
"""
from dataclasses import dataclass

import torch

from kstep.layers.attention import KVCache, Segment
from kstep.models.network import Network
from kstep.runner.kv_pool import KVBudgetExceeded, KVPool, pool_for
from kstep.runner.prefix_cache import PrefixCache
from kstep.runner.pass_output import PassOutput
from kstep.runner.top_tokens import TopRequest, local_stats, merge


def positions_from_padding(key_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool, True = real token -> (B, L) positions counting real tokens only (pads get 0)."""
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass(slots=True)
class ForwardPass:
    """What one sequence (a batch of b rows) needs from a forward pass."""
    ids: torch.Tensor                # (b, T) tokens to run
    positions: torch.Tensor          # (b, T)
    mask: torch.Tensor | None        # (b, 1, T|1, S) bool, True = may attend
    logits_from: int                 # logits for the run's positions [logits_from, logits_to)
    logits_to: int
    kind: str                        # full | window | prefill | decode | verify | block (timings and metrics)
    runner: "ModelRunner"            # the model that runs it (a speculative step's draft passes: the draft's)
    kv: KVCache | None = None
    cache_start: int = 0
    cache_len: int | None = None
    cache_slots: torch.Tensor | None = None   # (b, T): per-row write slots (rows of different lengths)
    logits_columns: torch.Tensor | None = None  # only these of [logits_from, logits_to) (lean logits)
    # A two-mode model's (DiffusionGemma): "encoder" (causal, writes the cache) or "decoder"
    # (bidirectional over [prefix; canvas]), and a decoder pass's self-conditioning signal (b, T, D).
    mode: str | None = None
    soft_embeds: torch.Tensor | None = None
    # A greedy rule's ask: top tokens instead of logits, where the runner computes them (top_tokens.py).
    top: TopRequest | None = None

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()


class ModelRunner:
    def __init__(self, model: Network):
        self.model = model
        self.cfg = model.cfg
        self.device = model.embed.weight.device
        self.dtype = model.embed.weight.dtype
        # Tensor parallel: a pass that asks for top tokens gets them from vocabulary-shard statistics
        # (one small gather) instead of gathered logits. One device: the logits, bit-equal to the references'.
        self.computes_top_tokens = model.tp is not None
        self.kv_pool: KVPool | None = None  # made once the budget is known (make_kv_pool)

    def close(self) -> None:
        """Release what the runner holds beyond memory (a tensor-parallel group's ranks); one device: nothing."""

    def expert_load(self) -> list[int] | None:
        """Per rank, the (token, expert) pairs its experts have run (tensor parallel); one device: None."""
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings on CUDA; a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def make_kv_pool(self, budget_bytes: int | None = None) -> KVPool:
        """The pool every cache of this model comes from, made once (runner/kv_pool.py: `budget_bytes`,
        else the default budget)."""
        self.kv_pool = pool_for(self.model, self.device, self.dtype, budget_bytes)
        return self.kv_pool

    def allocate_kv(self, batch: int, length: int) -> KVCache:
        """One sequence's KV cache for its whole life, from the model's pool (no per-step allocation or
        concatenation); PoolFull when its pages are not free now (the engine admits it later)."""
        if length > self.cfg.max_positions:
            raise ValueError(f"prompt + max_tokens ({length}) exceeds the model's context of {self.cfg.max_positions}")
        return self.check_kv_fits(batch, length).allocate(batch, length)

    def check_kv_fits(self, batch: int, length: int) -> KVPool:
        """The pool, once sure a cache of `batch` rows of `length` slots fits it when empty
        (KVBudgetExceeded: a request that could never run)."""
        pool = self.kv_pool or self.make_kv_pool()  # a runner built without one (a benchmark): the default
        needed = batch * pool.pages.pages_for(length)
        if needed > pool.pages.capacity:
            raise KVBudgetExceeded(f"this request needs {needed * pool.page_tokens} KV slots ({batch} rows of "
                                   f"{length}); the model's KV pool holds {pool.capacity_tokens} "
                                   f"({pool.nbytes / 2**20:.1f} MiB: --kv-cache-memory / --memory-utilization)")
        return pool

    def grow_kv(self, kv: KVCache, length: int) -> KVCache:
        """`kv` with the pages `length` slots need (taken from the pool, no copy; PoolFull, nothing
        changed, when too few are free): a request's cache grows as it decodes."""
        if length > self.cfg.max_positions:
            raise ValueError(f"prompt + max_tokens ({length}) exceeds the model's context of {self.cfg.max_positions}")
        self.check_kv_fits(kv.batch, length).grow(kv, length)
        return kv

    def copy_kv(self, src: KVCache, dst: KVCache, src_rows: list[int], dst_rows: list[int]) -> None:
        """Rows of one KV cache into rows of another (every layer, the slots both have): self-speculation's drafts."""
        src.copy_rows(dst, src_rows, dst_rows)

    def make_prefix_cache(self, budget_bytes: int, block_size: int) -> PrefixCache:
        """A prefix cache for this model's requests, its blocks pages of the model's KV pool."""
        return PrefixCache(budget_bytes, block_size, self.kv_pool or self.make_kv_pool())

    def _positions(self, key_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
        if key_mask is None:
            return torch.arange(length, device=self.device).expand(batch, -1)
        return positions_from_padding(key_mask)

    # --- Pass builders: the three kinds of pass the decoders need --------------------------------

    def full_pass(self, ids: torch.Tensor, key_mask: torch.Tensor | None, logits_from: int, logits_to: int,
                  kv: KVCache | None = None, columns: torch.Tensor | None = None) -> ForwardPass:
        """A bidirectional pass over the whole canvas ids (B, L); with kv, every position's keys/values
        are stored for later window passes. Logits only for [logits_from, logits_to), and of those
        only `columns` when given: computing the LM head for the positions that can change keeps
        memory from growing with canvas x vocabulary, and its work with what is still masked."""
        mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, L)
        return ForwardPass(ids, self._positions(key_mask, *ids.shape), mask, logits_from, logits_to, "full", self,
                           kv, logits_columns=columns)

    def window_pass(self, ids: torch.Tensor, key_mask: torch.Tensor | None, start: int, end: int,
                    attend_len: int, num_logits: int, kv: KVCache, columns: torch.Tensor | None = None) -> ForwardPass:
        """A bidirectional pass over only ids[:, start:end] of the canvas ids (B, L), attending to the
        cached keys/values of slots [0, attend_len) with this window's fresh ones written in place;
        logits for the window's first `num_logits` positions (only `columns` of them when given).
        Fast-dLLM's prefix cache runs the window [block start, L); its DualCache runs the block alone."""
        mask = None if key_mask is None else key_mask[:, None, None, :attend_len]  # (B, 1, 1, S)
        positions = self._positions(key_mask, *ids.shape)[:, start:end]
        return ForwardPass(ids[:, start:end], positions, mask, 0, num_logits, "window", self, kv, start,
                           attend_len, logits_columns=columns)

    def causal_pass(self, ids: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor | None,
                    cache_start: int, kv: KVCache) -> ForwardPass:
        """A causal pass of ids (B, T) written into the cache at [cache_start, cache_start+T); logits of
        the last position. key_mask (B, >= cache_start+T) marks real (non-pad) cache slots."""
        T, end = ids.shape[1], cache_start + ids.shape[1]
        mask = None if key_mask is None else key_mask[:, None, None, :end]  # (B, 1, 1, S)
        if T > 1 and (mask is not None or cache_start > 0):
            causal = torch.ones(T, end, dtype=torch.bool, device=self.device).tril(cache_start)  # (T, S)
            # Each query may see itself, so a left-pad query never has an all-masked row (NaN on some kernels).
            itself = causal.triu(cache_start)  # (T, S): the diagonal
            mask = causal if mask is None else (mask & causal) | itself  # (B, 1, T, S)
        return ForwardPass(ids, positions, mask, T - 1, T, "prefill" if cache_start == 0 or T > 1 else "decode", self,
                           kv, cache_start)

    def ragged_causal_pass(self, ids: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor,
                           real: torch.Tensor, kv: KVCache, is_causal: bool | torch.Tensor = True, kind: str = "verify",
                           columns: torch.Tensor | None = None, block_size: int | None = None,
                           attend_until: torch.Tensor | None = None,
                           write_slots: torch.Tensor | None = None) -> ForwardPass:
        """A pass where each row b writes its T tokens at its own slots [starts[b], starts[b]+T) and
        attends to its cached slots before starts[b] that `real` (B, S_max) marks, plus this pass's
        tokens: up to itself (`is_causal`: speculative verification), up to the end of its own run of
        `block_size` (block-causal: a finished block and the next one of a block-diffusion model), or
        all of them (one block). Logits for the T positions (only `columns` of them when given).
        `attend_until` (B,): the queries also see the cached slots up to there (Fast-dLLM v2's block
        cache: a sub-block against its whole block's keys); `write_slots` (B, T): where each token's
        keys go instead (a slot never attended, for tokens whose cached keys must stay). `is_causal` may
        be (B,) bool: causal rows and one-block rows in one pass (Nemotron's commits and denoising)."""
        B, T = ids.shape
        offsets = torch.arange(T, device=self.device)
        slots = starts[:, None] + offsets  # (B, T)
        attend_len = int(slots.max()) + 1 if attend_until is None else int(attend_until.max())
        key = torch.arange(attend_len, device=self.device)  # (S,)
        cached = real[:, :attend_len] & (key < (starts if attend_until is None else attend_until)[:, None])  # (B, S)
        if write_slots is not None:
            slots = write_slots
        if isinstance(is_causal, torch.Tensor):
            last = torch.where(is_causal[:, None, None], slots[:, :, None], slots[:, -1:, None])  # (B, T, 1)
        elif is_causal:
            last = slots[:, :, None]  # (B, T, 1)
        elif block_size is not None:
            last = (starts[:, None] + (offsets // block_size + 1) * block_size - 1)[:, :, None]  # (B, T, 1)
        else:
            last = slots[:, -1:, None]  # (B, 1, 1)
        new = (key[None, None, :] >= starts[:, None, None]) & (key[None, None, :] <= last)  # (B, T|1, S)
        mask = (cached[:, None, :] | new)[:, None]  # (B, 1, T|1, S)
        return ForwardPass(ids, positions, mask, 0, T, kind, self, kv, 0, attend_len, slots, columns)

    def block_prefill_pass(self, ids: torch.Tensor, key_mask: torch.Tensor | None, block_size: int,
                           kv: KVCache, start: int = 0) -> ForwardPass:
        """Block-causal pass over left-padded prompts ids (B, W) (bidirectional inside blocks of
        `block_size` positions, causal across) for columns [start, W), written into the cache there;
        columns before `start` are already cached (a shared prefix). Logits of the last position."""
        B, W = ids.shape
        positions = self._positions(key_mask, B, W)
        blocks = positions // block_size  # (B, W)
        mask = blocks[:, None, :] <= blocks[:, start:, None]  # (B, W - start, W): key block <= query block
        if key_mask is not None:  # pads are never keys; a pad query sees itself (no all-masked row)
            itself = torch.eye(W, dtype=torch.bool, device=ids.device)[start:]
            mask = (mask & key_mask[:, None, :]) | itself
        return ForwardPass(ids[:, start:], positions[:, start:], mask[:, None], W - start - 1, W - start, "prefill",
                           self, kv, start)

    # --- Execution ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, passes: list[ForwardPass]) -> list[PassOutput]:
        """Run the passes as one packed forward pass; per pass, its outputs at its (b, logits_to -
        logits_from) positions: the logits, or (tensor parallel, where it asks) top tokens. A
        tensor-parallel rank other than 0 gets []."""
        segments, offset = [], 0
        for p in passes:
            b, T = p.ids.shape
            segments.append(Segment(offset, b, T, p.mask, p.kv, p.cache_start, p.cache_len, p.cache_slots))
            offset += b * T
        ids = torch.cat([p.ids.reshape(-1) for p in passes]) if len(passes) > 1 else passes[0].ids.reshape(-1)
        positions = torch.cat([p.positions.reshape(-1) for p in passes]) if len(passes) > 1 \
            else passes[0].positions.reshape(-1)
        modes = {} if all(p.mode is None for p in passes) else \
            {"modes": [p.mode for p in passes], "soft_embeds": [p.soft_embeds for p in passes]}
        hidden = self.model.packed_hidden_states(ids, positions, segments, **modes)  # (N, D)
        wanted = [hidden[s.rows].view(s.batch, s.length, -1)[:, p.logits_from:p.logits_to]
                  for p, s in zip(passes, segments)]  # each (b, t, D)
        wanted = [w if p.logits_columns is None else w[:, p.logits_columns] for p, w in zip(passes, wanted)]
        if self.computes_top_tokens and any(p.top is not None for p in passes):
            return self._outputs_with_top_tokens(passes, wanted)
        if len(passes) == 1:
            logits = self.model.logits(wanted[0])
            return [] if logits is None else [PassOutput.of_logits(logits)]  # None: a tensor-parallel rank other than 0
        # One LM-head matmul for every sequence: the head is the largest weight of a small model.
        logits = self.model.logits(torch.cat([w.reshape(-1, w.shape[-1]) for w in wanted]))  # (sum b*t, V)
        if logits is None:
            return []
        sizes = [w.shape[0] * w.shape[1] for w in wanted]
        return [PassOutput.of_logits(chunk.view(w.shape[0], w.shape[1], logits.shape[-1]))  # (a pass may want none)
                for chunk, w in zip(logits.split(sizes), wanted)]

    def _outputs_with_top_tokens(self, passes: list[ForwardPass], wanted: list[torch.Tensor]) -> list[PassOutput]:
        """Per pass, its logits or (where it asks) its top tokens: one LM-head matmul over every
        pass's rows on this rank's vocabulary slice, then one gather of the logits passes' columns
        and one of the top-token passes' statistics (rank 0 gets them; the others get [])."""
        model, group = self.model, self.model.tp
        gather = (lambda x: x) if group is None else group.gather_last_dim
        local = model.local_logits(torch.cat([w.reshape(-1, w.shape[-1]) for w in wanted]))  # (R, V / N)
        chunks = local.split([w.shape[0] * w.shape[1] for w in wanted])
        start, real = model.vocab_columns()
        asks = [p.top is not None for p in passes]
        dense = [c for c, asked in zip(chunks, asks) if not asked]
        logits = gather(torch.cat(dense)) if dense else None  # (rows, V padded)
        stats = gather(torch.cat([local_stats(c[:, :real], start, p.top)
                                  for c, p, asked in zip(chunks, passes, asks) if asked]))  # (rows, N * NUM_STATS)
        if stats is None:
            return []
        ranks = 1 if group is None else group.size
        tops = iter(merge(stats.view(stats.shape[0], ranks, -1)).split([c.shape[0] for c, a in zip(chunks, asks) if a]))
        logits = iter(() if logits is None else logits[:, :self.cfg.vocab_size].split([c.shape[0] for c in dense]))
        return [PassOutput.of_top_tokens(next(tops).view(w.shape[0], w.shape[1], -1), p.top.exclude_id) if asked
                else PassOutput.of_logits(next(logits).view(w.shape[0], w.shape[1], -1))
                for p, asked, w in zip(passes, asks, wanted)]

    def logits(self, forward_pass: ForwardPass) -> torch.Tensor:
        """One pass alone: its logits."""
        return self.execute([forward_pass])[0].logits

    def whole_pass(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of a plain pass over ids (B, T) at positions (B, T), as `model(ids, positions)` (a fresh cache
        for a model whose attention always writes one: DiffusionGemma)."""
        kv = self.allocate_kv(*ids.shape) if self.model.always_writes_kv else None
        return self.logits(ForwardPass(ids, positions, None, 0, ids.shape[1], "full", self, kv))

    @torch.inference_mode()
    def soft_embedding(self, logits: torch.Tensor) -> torch.Tensor:
        """DiffusionGemma's self-conditioning signal (..., D) from a pass's processed logits (..., V)."""
        return self.model.soft_embedding(logits)

    def probs_embedder(self):  # DiffusionGemma in float32: soft_embedding from the sampler's softmax (soft_probs)
        return self.model.embed_probs if self.model.embed.weight.dtype == torch.float32 else None


def asking(passes: list[ForwardPass], top: TopRequest | None) -> list[ForwardPass]:
    """The passes, each asking for top tokens instead of logits (`top`; None: the logits)."""
    for forward in passes:
        forward.top = top
    return passes


def execute_passes(passes: list[ForwardPass]) -> list[PassOutput]:
    """Run passes that may belong to different runners (a target and its draft model): one packed
    pass per runner; outputs in the order of `passes`."""
    by_runner: dict[int, list[int]] = {}
    for i, p in enumerate(passes):
        by_runner.setdefault(id(p.runner), []).append(i)
    logits: list[PassOutput | None] = [None] * len(passes)
    for indices in by_runner.values():
        for i, out in zip(indices, passes[indices[0]].runner.execute([passes[i] for i in indices]), strict=True):
            logits[i] = out
    return logits
