"""What a training run is told (`kstep train`'s flags are made from these fields): plain Python, so the
CLI builds its parser without importing torch or the trainer."""
from dataclasses import dataclass

OBJECTIVES = ("diffusion", "ar", "block-diffusion")


@dataclass(slots=True)
class TrainConfig:
    objective: str
    out: str
    corpus: str = "stdlib"
    tokenizer: str | None = None      # a directory with tokenizer.json to reuse (pairs share one)
    init_from: str | None = None      # start from this checkpoint's weights (e.g. to fine-tune)
    prompt_completion: bool = False   # train on (signature + docstring, body) pairs: loss on the body only
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 704
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    token_budget: int = 2_000_000
    eval_every: int = 200
    eval_windows: int = 32
    save_every: int = 200
    seed: int = 0
    threads: int | None = None
    stratified_t: bool = False        # diffusion: MDLM's low-discrepancy t across the batch
    bf16: bool = False                # bf16 autocast: slower on this CPU build (backward matmuls), off by default
    max_positions: int = 2048
    block_size: int = 8               # block-diffusion: tokens per block
    complementary_masks: bool = True  # block-diffusion: each row also with the opposite mask
    mask_ratio_min: float = 0.0       # block-diffusion: each block's mask ratio ~ U(min, max)
    mask_ratio_max: float = 1.0
    certainty_weight: float = 0.0     # block-diffusion: dParallel's certainty forcing
    distill_data: str | None = None   # JSONL of {prompt_ids, completion_ids} (kstep distill): trained as pairs
    real_data_fraction: float = 0.0   # with distill_data: this share of each batch from the corpus windows

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"--objective {self.objective!r} must be one of {', '.join(OBJECTIVES)}")
        for name in ("d_model", "n_layers", "n_heads", "ffn_dim", "seq_len", "batch_size", "token_budget"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.objective == "block-diffusion" and self.seq_len % self.block_size:
            raise ValueError(f"--seq-len ({self.seq_len}) must be a multiple of --block-size ({self.block_size})")
        if not 0 <= self.mask_ratio_min <= self.mask_ratio_max <= 1:
            raise ValueError("--mask-ratio-min/max must satisfy 0 <= min <= max <= 1")
        if not 0 <= self.real_data_fraction <= 1:
            raise ValueError(f"--real-data-fraction must be in [0, 1], got {self.real_data_fraction}")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model ({self.d_model}) must be a multiple of --n-heads ({self.n_heads})")

    @property
    def total_steps(self) -> int:
        return max(1, self.token_budget // (self.batch_size * self.seq_len))
