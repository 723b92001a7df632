"""Uniform (random-start) block diffusion: DiffusionGemma's `generate` (transformers 5.24,
`DiffusionGemmaGenerationMixin.generate`, text path), as a kstep step machine.

A request's rows go through canvases of `canvas_length` tokens together, as transformers' batch does:
1. an encoder pass (causal, writes the KV cache): the prompt's prefill, later the commit of the
   last canvas;
2. a canvas of uniformly random tokens, then up to `max_denoising_steps` decoder passes over it
   (bidirectional over [prefix; canvas], self-conditioned from the second pass on the previous
   pass's soft embedding). Each pass re-predicts every position: the processed logits (filters,
   then the temperature t_min + (t_max - t_min) * steps_left / N) give a sample per position and
   the argmax canvas; the lowest-entropy positions under the entropy bound keep their sample as the
   next input, every other position gets a fresh random token (nothing is frozen: a token may change
   at any pass);
3. a row stops denoising once its argmax canvas equals the last `stability_threshold` ones and its
   mean entropy is below `confidence_threshold` (frozen, but computed while other rows run, as in
   transformers); the canvas ends when every row stopped or after N passes;
4. the argmax canvas is committed: its tokens are final (streamed as committed text), a stop token
   anywhere in it ends the row, and the next canvas starts with the commit's encoder pass. The last
   canvas is never encoded.

Random draws follow transformers' order exactly (per canvas: the canvas; per pass: the multinomial
sample of every position, then the renoise tokens), from the request's generator (`seed`: a
torch.Generator on the model's device seeded with it) or torch's global one, so a seeded CPU run
reproduces `torch.manual_seed(seed); model.generate(...)`. kstep's temperature scales the schedule
(1: transformers'); 0 is transformers' deterministic run, a top-1 logits filter. kstep cuts the
completion to max_tokens; transformers returns whole canvases.
"""
from dataclasses import replace

import torch

from kstep.decoding.base import DecodeBatch, Decoder, DecoderResources
from kstep.decoding.sampling import OutputRules
from kstep.decoding.entropy_bound import accept, is_stable, sample_positions, temperature
from kstep.decoding.row_tiles import tiled
from kstep.decoding.walk_candidates import WalkCandidates
from kstep.models.diffusion_gemma_layers import DECODER, ENCODER
from kstep.outputs import StepOutput
from kstep.params import GenerationParams
from kstep.runner.model_runner import ForwardPass, ModelRunner, positions_from_padding
from kstep.runner.pass_output import PassOutput


class UniformDiffusionDecoder(Decoder):
    keeps_grammar = True
    def __init__(self, runner: ModelRunner, batch: DecodeBatch, params: GenerationParams,
                 resources: DecoderResources = DecoderResources()):
        self.runner, self.params, self.generator = runner, params, batch.generator
        self.stop_ids = batch.stop_ids[:0] if params.ignore_eos else batch.stop_ids
        self.all_stop_ids, self.first_allowed, self.include_canvas = batch.stop_ids, batch.first_allowed, \
            batch.include_canvas
        self.grammar = batch.constraint  # walked in order (_keep_grammar), not a mask of the whole canvas
        self.output_rules = replace(OutputRules.of(batch, params), grammar=None)
        prompts, key_mask = batch.prompts, batch.key_mask
        B, W = prompts.shape
        L, self.vocab_size = runner.cfg.canvas_length, runner.cfg.vocab_size
        self.canvas_length, self.prompt_width = L, W
        self.num_canvases = -(-params.max_tokens // L)
        device = self.device = prompts.device
        slots = W + self.num_canvases * L  # the last canvas's passes write its slots as scratch
        self.kv = runner.allocate_kv(B, slots)
        self.real = None if key_mask is None else torch.cat([key_mask, key_mask.new_ones(B, slots - W)], dim=1)
        self.prompt_lengths = key_mask.sum(-1) if key_mask is not None else torch.full((B,), W, device=device)
        self.to_encode = prompts  # (B, T) the next encoder pass's tokens
        self.encode_positions = positions_from_padding(key_mask) if key_mask is not None else \
            torch.arange(W, device=device).expand(B, -1)
        self.canvas_idx, self.is_encoding = 0, True
        self.encoded = 0  # prompt columns in the cache (its prefill may run in chunks: base.Decoder.prefill_chunk)
        self.completions = torch.zeros(B, self.num_canvases * L, dtype=torch.long, device=device)
        self.row_finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.row_nfe = torch.zeros(B, dtype=torch.long, device=device)
        self.decoder_passes = torch.zeros(B, dtype=torch.long, device=device)  # transformers' count
        self.steps_per_canvas: list[int] = []
        self.nfe, self.is_finished = 0, False
        self.lengths = [0] * B  # committed tokens reported per row

    # --- the passes -------------------------------------------------------------------------------

    def _slot(self) -> int:
        """Cache slot of the next pass's first token: 0 for the prefill; a commit writes the canvas
        before the current one, a decoder pass writes the current one's (as scratch)."""
        if self.is_encoding:
            return 0 if self.canvas_idx == 0 else self.prompt_width + (self.canvas_idx - 1) * self.canvas_length
        return self.prompt_width + self.canvas_idx * self.canvas_length

    def step_tokens(self) -> int:
        """Its canvas: every denoising pass runs all of it."""
        return self.completions.shape[0] * self.canvas_length

    def next_passes(self) -> list[ForwardPass]:
        if self.is_finished:
            return []
        ids, positions = (self.to_encode, self.encode_positions) if self.is_encoding else (self.canvas, None)
        start = self._slot()
        if self.is_encoding and self.canvas_idx == 0:  # the prompt, whole or its next chunk (causal: any columns)
            end = self.next_chunk(self.encoded, self.prompt_width, ids.shape[0])
            if end is None:
                return []  # waits for a step with room
            start, ids, positions = self.encoded, ids[:, self.encoded:end], positions[:, self.encoded:end]
            self.encoded = end
        end = start + ids.shape[1]
        mask = None if self.real is None else self.real[:, None, None, :end]  # (B, 1, 1, S) key padding
        if self.is_encoding:  # no logits: only its keys and values matter
            kind = "prefill" if self.canvas_idx == 0 else "commit"
            return [ForwardPass(ids, positions, mask, ids.shape[1], ids.shape[1], kind, self.runner,
                                self.kv, start, end, mode=ENCODER)]
        positions = self.prompt_lengths[:, None] + self.canvas_idx * self.canvas_length + \
            torch.arange(self.canvas_length, device=self.device)  # (B, L)
        return [ForwardPass(ids, positions, mask, 0, self.canvas_length, "denoise", self.runner, self.kv, start, end,
                            mode=DECODER, soft_embeds=self.soft)]

    def update(self, outputs: list[PassOutput]) -> StepOutput:
        if not outputs:  # its prefill's chunk waited
            return self._output()
        [out] = outputs
        self.nfe += 1
        if self.is_encoding and self.encoded < self.prompt_width:  # a prefill chunk before its last
            self.row_nfe += 1
        elif self.is_encoding:
            self.row_nfe += ~self.row_finished
            self._start_canvas()
        else:
            self._denoise(out.logits)  # its rules read whole distributions
        return self._output()

    def _random_tokens(self) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, self.canvas_shape, generator=self.generator, device=self.device)

    def _start_canvas(self) -> None:
        """The prefix is encoded: a canvas of random tokens, and a fresh stopping history."""
        B, p = self.to_encode.shape[0], self.params
        self.canvas_shape = (B, self.canvas_length)
        self.canvas = self.argmax = self._random_tokens()  # (B, L)
        self.soft: torch.Tensor | None = None  # (B, L, D) self-conditioning signal; none at the first pass
        self.done = torch.zeros(B, dtype=torch.bool, device=self.device)
        self.history = torch.full((p.stability_threshold, *self.canvas_shape), -1, dtype=torch.long, device=self.device)
        self.steps_left, self.is_encoding = p.max_denoising_steps, False

    def _denoise(self, logits: torch.Tensor) -> None:
        """One decoder pass's update (module note, step 2-3); commits when the canvas ends."""
        p = self.params
        ran = ~(self.done | self.row_finished)  # a row that stopped denoising would need no pass alone
        self.decoder_passes += ran
        self.row_nfe += ran
        temp = temperature(p.t_min, p.t_max, self.steps_left, p.max_denoising_steps, self.device)
        output_index = self.canvas_idx * self.canvas_length + torch.arange(self.canvas_length, device=self.device)
        # the next pass's signal from the draw's softmax where it can (not after a canvas's last pass)
        embed_probs = self.runner.probs_embedder() if self.steps_left > 1 else None
        processed, sampled, argmax, entropies, soft = sample_positions(
            logits, temp, p.temperature, p.top_k, p.top_p, output_index[None], self.output_rules,
            self.generator, embed_probs)  # (B, L, V), then (B, L) each, then (B, L, D) or None
        accepted = accept(entropies, p.entropy_bound)  # (B, L)
        canvas = torch.where(accepted, sampled, self._random_tokens())
        if self.grammar is not None:
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            argmax, canvas = self._keep_grammar(processed, probs, accepted, argmax, canvas)
        done = self.done[:, None]  # rows that stopped keep their canvas
        argmax, canvas = torch.where(done, self.argmax, argmax), torch.where(done, self.canvas, canvas)
        stable, self.history = is_stable(self.history, argmax)
        self.done = self.done | (stable & (entropies.mean(-1) < p.confidence_threshold))
        self.canvas, self.argmax, self.steps_left = canvas, argmax, self.steps_left - 1
        if self.steps_left == 0 or bool(self.done.all()):
            self._commit()
        else:
            self.soft = soft if soft is not None else tiled(self.runner.soft_embedding, processed, for_matmul=True)

    def _keep_grammar(self, processed: torch.Tensor, probs: torch.Tensor, accepted: torch.Tensor,
                      free_argmax: torch.Tensor, free_canvas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The argmax canvas and the next input canvas under a structured output's grammar, each walked
        from the row's frontier (Constraint.walk): the argmax among the tokens allowed there; the kept
        samples drawn among them, and the renoised positions' random tokens too (nothing leaves the
        grammar, not even noise). The candidates come to the host once per pass (walk_candidates.py);
        the random draws follow the walk, not transformers' order. A row the grammar does not walk
        (released, or done) keeps the unconstrained `free_argmax` / `free_canvas`."""
        live = (~(self.done | self.row_finished)).tolist()
        index = list(range(self.canvas_idx * self.canvas_length, (self.canvas_idx + 1) * self.canvas_length))
        candidates = WalkCandidates(processed, probs, accepted, self.generator)
        return (self._walked(self.grammar.walk(index, candidates.best, live), free_argmax),
                self._walked(self.grammar.walk(index, candidates.drawn, live), free_canvas))

    def _walked(self, walked: list[list[int] | None], free: torch.Tensor) -> torch.Tensor:
        """(B, L): the walked rows' tokens, the others' from `free` (B, L)."""
        if all(tokens is None for tokens in walked):
            return free
        is_walked = torch.tensor([tokens is not None for tokens in walked], device=self.device)
        tokens = torch.tensor([tokens or [0] * self.canvas_length for tokens in walked], device=self.device)
        return torch.where(is_walked[:, None], tokens, free)

    def _commit(self) -> None:
        """The argmax canvas is final; a stop token in it, or the last canvas, ends a row."""
        L, c = self.canvas_length, self.canvas_idx
        if self.grammar is not None:  # its walked tokens, into each row's matcher
            self.grammar.take([None if finished else row for row, finished in
                               zip(self.argmax.tolist(), self.row_finished.tolist(), strict=True)],
                              list(range(c * L, (c + 1) * L)))
        self.completions[:, c * L:(c + 1) * L] = self.argmax
        self.steps_per_canvas.append(self.params.max_denoising_steps - self.steps_left)
        stopped = torch.isin(self.argmax, self.stop_ids).any(-1) if len(self.stop_ids) else torch.zeros_like(self.done)
        self.row_finished |= stopped | (c + 1 == self.num_canvases)
        self.canvas_idx += 1
        self.soft = None
        if bool(self.row_finished.all()):
            self.is_finished, self.kv = True, None
            return
        self.is_encoding, self.to_encode = True, self.argmax
        self.encode_positions = self.prompt_lengths[:, None] + c * L + torch.arange(L, device=self.device)

    # --- results ----------------------------------------------------------------------------------

    def _output(self) -> StepOutput:
        """Rows report their committed canvases, up to max_tokens and their first stop token."""
        committed = min(self.canvas_idx * self.canvas_length, self.params.max_tokens)
        done = self.completions[:, :committed]
        if committed:
            is_stop = torch.isin(done, self.stop_ids)
            lengths = torch.where(is_stop.any(-1), is_stop.float().argmax(-1) + 1, committed).tolist()
        else:
            lengths = self.lengths
        rows = done.tolist() if committed > max(self.lengths) or self.include_canvas else None
        new = [rows[b][old:n] if rows is not None else [] for b, (old, n) in enumerate(zip(self.lengths, lengths))]
        self.lengths = lengths
        canvas = None
        if self.include_canvas:  # what is committed, then the refining canvas's argmax (its last pass's)
            refining = [] if self.is_encoding or self.is_finished else self.argmax[:, :self.params.max_tokens -
                                                                                     committed].tolist()
            canvas = [row + (refining[b] if refining else []) for b, row in enumerate(rows)]
        return StepOutput(new, lengths, self.row_finished.tolist(), self.row_nfe.tolist(), self.nfe, self.is_finished,
                          canvas)

    def stats(self, row: int | None = None) -> dict[str, float]:
        """Decoder passes per canvas (data-dependent: the stopping rule) and canvases run: the batch's
        (its rows run their canvases together)."""
        n = len(self.steps_per_canvas)
        return {"num_canvases": float(n), "denoising_passes_per_canvas": sum(self.steps_per_canvas) / n if n else 0.0}
