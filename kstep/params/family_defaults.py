"""The knob values a family fills in for a request before it is resolved: its own (a block model's
block size, a tri-mode model's mode), the ones its checkpoint's generation_config.json gives, and
which per-model defaults a request of a given mode takes. Plain Python, no torch."""
from kstep.params.generation import GenerationParams, knob_applies
from kstep.registry import BLOCK_DIFFUSION, SELF_SPECULATION, Family

# generation_config.json keys kstep takes, and the knob each sets (Fast-dLLM v2 calls sub_block_length small_block_size)
CHECKPOINT_KNOBS = {"eps": "eps", "alg_temp": "alg_temp", "threshold": "threshold", "small_block_size": "sub_block_length",
                    "editing_threshold": "editing_threshold", "max_post_steps": "max_post_steps"}


def knob_defaults(family: Family, block_size: int | None, params: GenerationParams) -> dict:
    """Generation knobs `family` fills in for a request: a tri-mode model's mode (its first) and
    LinearSpec's drafts (a block: the block size - 1), a block model's block size (its checkpoint's:
    `block_size`),
    Fast-dLLM v2's sub-block of 8 where it divides the block (else the whole block), and the
    reference's threshold where the request chose no other unmask policy."""
    defaults = {"mode": params.mode or next(iter(family.modes))} if family.modes else {}
    if defaults.get("mode") == SELF_SPECULATION:
        defaults["num_draft_tokens"] = block_size - 1
    if family.kind_for(params.mode) != BLOCK_DIFFUSION:
        return defaults
    block = params.block_length or block_size
    defaults["block_length"] = block
    if family.sub_block_length and block % family.sub_block_length == 0:
        defaults["sub_block_length"] = family.sub_block_length
    if family.threshold is not None and not (params.exact or params.draft):
        defaults["threshold"] = family.threshold
    return defaults


def defaults_for_mode(family: Family, defaults: dict, mode: str | None) -> dict:
    """Per-model defaults (`kstep serve`'s flags) that a request of `mode` takes: a tri-mode model's
    knobs for another mode's kind (a `--threshold` under `mode` ar) are left out, not refused."""
    if not family.modes:
        return defaults
    kind = family.modes.get(mode or next(iter(family.modes)), family.kind)  # a bad mode: refused by its params
    return {k: v for k, v in defaults.items() if knob_applies(k, family.name, kind)}


def checkpoint_defaults(family: Family, raw: dict) -> dict:
    """Knob values a checkpoint's generation_config.json (`raw`) gives for knobs kstep leaves unset
    by default, as vLLM takes a checkpoint's sampling defaults: Dream's `eps`, `alg_temp`; a block
    model's `threshold` and `small_block_size`. The family's own (a block model's block size) come
    from knob_defaults. Its other keys (e.g. Dream's `steps: 512`, `alg: origin`) are not taken:
    kstep's defaults decide those. A layout that names knobs its own way reads them itself."""
    if hasattr(family.layout, "generation_defaults"):  # knobs under the checkpoint's own names (DiffusionGemma)
        return family.layout.generation_defaults(raw)
    return {knob: raw[key] for key, knob in CHECKPOINT_KNOBS.items() if raw.get(key) is not None
            and knob_applies(knob, family.name, family.kind)}
