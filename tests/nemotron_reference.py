"""Nemotron-Labs-Diffusion's remote code at inference, restated for parity tests (tests only: kstep never
runs a checkpoint's code).

Source: `modeling_nemotron_labs_diffusion.py` of the released checkpoints (nvidia/Nemotron-Labs-Diffusion-
{3B,8B,14B} on Hugging Face; its text as indexed from public GitHub copies, and as the public ports
restate it: Blaizzy/mlx-vlm `mlx_vlm/models/nemotron_labs_diffusion/language.py`, axolotl's native
Nemotron loader) and the `modeling_ministral.py` it imports, a vendored transformers Ministral 3 whose
attention has a `diffusion_lm` switch. The network here is transformers' own `Ministral3Model` (the
one that file vendors: YaRN rotary, queries times `get_llama_4_attn_scale` at their cache positions,
RMSNorm, SwiGLU), loaded from the `encoder.*` tensors, with `diffusion_head` as the LM head. The remote
attention differs from it in two ways, restated in `ReferenceNemotron.forward`:
- `diffusion_lm=True` (bidirectional): the attention gets no mask, `is_causal=False`: every query sees
  the whole cache and every token of the call (here: a 4D all-True mask, which transformers passes on);
- `use_cache=False` with a cache: the cached keys/values go before the call's and the cache is not
  updated (here: the call appends to the DynamicCache, which is then cropped back).
`generate` (block diffusion, `causal_context=True`), `ar_generate` and `linear_spec_generate` follow the
remote methods line by line at temperature 0 and batch one (their loops, stops and nfe counts),
without the thinking budget, the LoRA adapter toggles or sampling. Written for clarity, not speed.
"""
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import DynamicCache, Ministral3Config, Ministral3Model


class ReferenceNemotron:
    def __init__(self, path: Path):
        raw = json.loads((Path(path) / "config.json").read_text())
        self.config = Ministral3Config(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
            max_position_embeddings=raw["max_position_embeddings"], rms_norm_eps=raw["rms_norm_eps"],
            rope_parameters=dict(raw["rope_parameters"]), tie_word_embeddings=False, pad_token_id=raw["pad_token_id"],
            sliding_window=None)
        self.config._attn_implementation = "sdpa"
        self.encoder = Ministral3Model(self.config).eval()
        tensors = load_file(str(Path(path) / "model.safetensors"))
        own = {k.removeprefix("encoder."): v for k, v in tensors.items() if k.startswith("encoder.")}
        missing, unexpected = self.encoder.load_state_dict(own, strict=False)
        assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
        self.head = tensors["diffusion_head.weight"]  # (V, D)
        self.mask_id = raw["mask_token_id"]

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: DynamicCache, *, bidirectional: bool, use_cache: bool) -> torch.Tensor:
        """Logits (B, T, V) of `ids` (B, T) after the cached ones: the remote encoder + diffusion_head."""
        past = cache.get_seq_length()
        mask = torch.ones(ids.shape[0], 1, ids.shape[1], past + ids.shape[1], dtype=torch.bool) if bidirectional \
            else None  # None: transformers' causal mask
        hidden = self.encoder(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask).last_hidden_state
        if not use_cache:
            crop(cache, past)
        return hidden @ self.head.T


def crop(cache: DynamicCache, length: int) -> None:
    """The remote `_crop_dynamic_cache`: keep the first `length` cached positions (this transformers'
    crop takes the number to drop, negated)."""
    cache.crop(length - cache.get_seq_length())


def _num_transfer_tokens(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    """`_get_num_transfer_tokens`: the masks split evenly over `steps`, the remainder first."""
    mask_num = mask_index.sum(dim=1, keepdim=True)
    counts = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + mask_num // steps
    for i in range(mask_num.size(0)):
        counts[i, : int(mask_num[i] % steps)] += 1
    return counts


def _transfer_index(logits, mask_index, x, num_transfer_tokens, threshold):
    """`_get_transfer_index` at temperature 0: the argmax (the mask token not excluded), its softmax
    probability as confidence; the top `num_transfer_tokens`, or with a threshold every masked
    position's top-k order kept while >= threshold, the first always."""
    x0 = torch.argmax(logits, dim=-1)
    p = F.softmax(logits, dim=-1)
    x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -torch.inf)
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer[j, select] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select[k]] < threshold:
                    transfer[j, select[k]] = False
    return x0, transfer


def generate(ref: ReferenceNemotron, prompt_ids: torch.Tensor, max_new_tokens: int, block_length: int,
             threshold: float | None = None, eos_token_id: int | None = None) -> tuple[torch.Tensor, int]:
    """`NemotronLabsDiffusionModel.generate` (causal_context=True, temperature 0): (ids incl. prompt, nfe)."""
    mask_id, P = ref.mask_id, prompt_ids.shape[1]
    if max_new_tokens % block_length:
        raise ValueError("the reference asserts max_new_tokens % block_length == 0")
    x, nfe, cache = prompt_ids.clone(), 0, ref.new_cache()
    logits = ref.forward(prompt_ids, cache, bidirectional=False, use_cache=True)  # the prefill: not counted
    next_token = logits[:, -1].argmax(-1, keepdim=True)
    for num_block in range(max_new_tokens // block_length):
        block = torch.full((x.shape[0], block_length), mask_id, dtype=x.dtype)
        block[:, 0] = next_token[:, 0]
        x = torch.cat([x, block], dim=1)
        sl = slice(P + num_block * block_length, P + (num_block + 1) * block_length)
        counts = _num_transfer_tokens(x[:, sl] == mask_id, block_length)  # steps_per_block = block_length
        for i in range(block_length):
            is_mask = x[:, sl] == mask_id
            if is_mask.sum() == 0:
                break
            nfe += 1
            logits = ref.forward(x[:, sl], cache, bidirectional=True, use_cache=False)
            x0, transfer = _transfer_index(logits, is_mask, x[:, sl], counts[:, i], threshold)
            current = x[:, sl].clone()
            current[transfer] = x0[transfer]
            x[:, sl] = current
            if eos_token_id is not None:
                tokens = x[:, sl]
                is_eos = tokens == eos_token_id
                if is_eos.any(dim=1).any():
                    masks_before = (tokens == mask_id) & ~is_eos.cumsum(dim=1).bool()
                    if (is_eos.any(dim=1) & ~masks_before.any(dim=1)).any():
                        break
        logits = ref.forward(x[:, sl], cache, bidirectional=False, use_cache=True)  # the block into the cache
        nfe += 1
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        if eos_token_id is not None:
            is_eos = x[:, P:] == eos_token_id
            if is_eos.any(dim=1).all():
                return x[:, : P + int(is_eos.long().argmax(dim=1).max()) + 1], nfe
    return x, nfe


def ar_generate(ref: ReferenceNemotron, prompt_ids: torch.Tensor, max_new_tokens: int,
                eos_token_id: int | None = None) -> tuple[torch.Tensor, int]:
    """`ar_generate` (temperature 0): causal throughout; nfe counts the tokens (not the prefill)."""
    cache = ref.new_cache()
    next_logit = ref.forward(prompt_ids, cache, bidirectional=False, use_cache=True)[:, -1]
    generated, nfe = [], 0
    for step in range(max_new_tokens):
        nfe += 1
        next_token = next_logit.argmax(-1, keepdim=True)
        generated.append(next_token)
        if eos_token_id is not None and (next_token == eos_token_id).all():
            break
        if step < max_new_tokens - 1:
            next_logit = ref.forward(next_token, cache, bidirectional=False, use_cache=True)[:, -1]
    return torch.cat([prompt_ids, *generated], dim=1), nfe


def linear_spec_generate(ref: ReferenceNemotron, prompt_ids: torch.Tensor, max_new_tokens: int,
                         block_length: int = 32, eos_token_id: int | None = None) -> tuple[torch.Tensor, int]:
    """`linear_spec_generate` (temperature 0, threshold 0, no LoRA): each round drafts [last token;
    block_length - 1 masks] in one bidirectional pass, verifies it causally (writing the cache), keeps
    the drafts while they equal the causal argmax plus that argmax, and crops the cache back to
    them. nfe counts the prefill. Its output may run past max_new_tokens (the last round's)."""
    mask_id, cache = ref.mask_id, ref.new_cache()
    last = ref.forward(prompt_ids, cache, bidirectional=False, use_cache=True)[:, -1]
    nfe = 1
    next_token = last.argmax(-1, keepdim=True)
    if eos_token_id is not None and next_token.item() == eos_token_id:
        return torch.cat([prompt_ids, next_token], dim=1), nfe
    generated, total = [next_token], 1
    while total < max_new_tokens:
        cache_len = cache.get_seq_length()
        block = torch.full((1, block_length), mask_id, dtype=torch.long)
        block[0, 0] = next_token.item()
        is_mask = block == mask_id
        draft = ref.forward(block, cache, bidirectional=True, use_cache=False).argmax(-1)
        nfe += 1
        block[is_mask] = draft[is_mask]
        ar_tokens = ref.forward(block, cache, bidirectional=False, use_cache=True).argmax(-1)
        nfe += 1
        accepted = 0
        for i in range(block_length - 1):
            if ar_tokens[0, i].item() != block[0, i + 1].item():
                break
            accepted += 1
        accepted += 1  # the bonus token
        kept = ar_tokens[:, :accepted]
        generated.append(kept)
        total += accepted
        crop(cache, cache_len + accepted)
        next_token = ar_tokens[:, accepted - 1: accepted]
        if eos_token_id is not None and (kept[0] == eos_token_id).any():
            generated[-1] = kept[:, : int((kept[0] == eos_token_id).nonzero()[0]) + 1]
            break
    return torch.cat([prompt_ids, *generated], dim=1), nfe
