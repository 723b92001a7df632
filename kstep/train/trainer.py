"""The training loop behind `kstep train`: AdamW, warmup + cosine schedule, bf16 autocast on the
CPU, a progress bar, resumable state (safetensors + JSON, never pickle), and a final checkpoint in
the family's real layout that `kstep.load` reads.
"""
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tqdm import tqdm

from kstep.models import ModelConfig, Transformer
from kstep.train import bpe, data
from kstep.train.block_objective import block_diffusion_loss
from kstep.train.objectives import ar_loss, ar_nll, diffusion_loss, diffusion_nll_bound
from kstep.train.config import OBJECTIVES, TrainConfig
from kstep.train.paths import PATH_KNOBS, portable_path
from kstep.weights import load_model, save_checkpoint

BLOCK_FAMILY = "fast_dllm_v2"  # the layout a block-diffusion model is written in


def model_config(cfg: TrainConfig, vocab_size: int, ids: dict[str, int]) -> ModelConfig:
    if cfg.objective == "block-diffusion":
        return ModelConfig(
            family=BLOCK_FAMILY, attention="block_causal", vocab_size=vocab_size, embedding_size=vocab_size,
            d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.d_model // cfg.n_heads, ffn_dim=cfg.ffn_dim, norm_eps=1e-5, rope_theta=10000.0,
            max_positions=cfg.max_positions, qkv_bias=True, tie_embeddings=False, mask_token_id=ids["mask"],
            pad_token_id=ids["pad"], eos_token_ids=(ids["eos"],), block_size=cfg.block_size)
    is_diffusion = cfg.objective == "diffusion"
    return ModelConfig(
        family="llada" if is_diffusion else "llama", attention="bidirectional" if is_diffusion else "causal",
        vocab_size=vocab_size,
        embedding_size=-(-vocab_size // 128) * 128 if is_diffusion else vocab_size, d_model=cfg.d_model,
        n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.d_model // cfg.n_heads,
        ffn_dim=cfg.ffn_dim, norm_eps=1e-5, rope_theta=10000.0, max_positions=cfg.max_positions,
        tie_embeddings=False, mask_token_id=ids["mask"] if is_diffusion else None, pad_token_id=ids["pad"],
        eos_token_ids=(ids["eos"],))


def init_weights(model: Transformer, seed: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    torch.manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.zeros_(p)
        else:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.state_dir = self.out / "train_state"
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.files = data.corpus_files(cfg.corpus)
        train_texts = data.texts([f for f in self.files if not f.is_held_out])
        self.tok = self._tokenizer(train_texts)
        bpe.save_tokenizer(self.tok, self.out)  # early, so a twin model can start from it right away
        self.ids = bpe.special_ids(self.tok)
        self.train_stream = data.tokenize(self.tok, train_texts, self.ids["eos"])
        held_out = data.tokenize(self.tok, data.texts([f for f in self.files if f.is_held_out]), self.ids["eos"])
        self.eval_batch = data.fixed_windows(held_out if len(held_out) > cfg.seq_len else self.train_stream,
                                             cfg.eval_windows, cfg.seq_len)
        self.pairs = None
        if cfg.distill_data:
            self.pairs = data.distill_pairs(Path(cfg.distill_data), self.ids["eos"], cfg.seq_len)
        elif cfg.prompt_completion:
            self.pairs = data.function_pairs(self.tok, [f for f in self.files if not f.is_held_out],
                                             self.ids["eos"], cfg.seq_len)
        self.model = Transformer(model_config(cfg, self.tok.get_vocab_size(), self.ids))
        init_weights(self.model, cfg.seed)
        if cfg.init_from:
            self._init_from(Path(cfg.init_from))
        decay = [p for p in self.model.parameters() if p.dim() == 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=cfg.lr, betas=(0.9, 0.95), fused=False)
        self.step, self.tokens_seen, self.log = 0, 0, []

    def _init_from(self, path: Path) -> None:
        """Start from a checkpoint of any family with the same sizes (e.g. an AR twin for a
        block-diffusion model): parameters are matched by kstep's names; any the source lacks (q/k/v
        biases of a Qwen2 layout) keep their initial value (zero)."""
        source = dict(load_model(path).named_parameters())
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in source:
                    if source[name].shape != p.shape:
                        raise ValueError(f"--init-from {path}: {name} has shape {list(source[name].shape)}, "
                                         f"expected {list(p.shape)}")
                    p.copy_(source[name])

    def _tokenizer(self, train_texts: list[str]) -> Tokenizer:
        if self.cfg.tokenizer:
            return Tokenizer.from_file(str(Path(self.cfg.tokenizer) / "tokenizer.json"))
        return bpe.train_byte_level_bpe(train_texts, self.cfg.vocab_size)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens, prompt_lengths or None) for a step; depends only on (seed, step), so a resumed
        run continues the same stream."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, step])
        if self.pairs is None:
            return data.sample_windows(self.train_stream, rng, cfg.batch_size, cfg.seq_len), None
        num_real = round(cfg.batch_size * cfg.real_data_fraction) if cfg.distill_data else 0
        rows = rng.integers(0, len(self.pairs[0]), size=cfg.batch_size - num_real)
        tokens, prompt_lengths = torch.from_numpy(self.pairs[0][rows]), torch.from_numpy(self.pairs[1][rows])
        if num_real:  # corpus windows: no prompt, every position may be masked
            tokens = torch.cat([tokens, data.sample_windows(self.train_stream, rng, num_real, cfg.seq_len)])
            prompt_lengths = torch.cat([prompt_lengths, torch.zeros(num_real, dtype=torch.long)])
        return tokens, prompt_lengths

    def loss(self, tokens: torch.Tensor, generator: torch.Generator,
             prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16 and tokens.device.type == "cpu"):
            if self.cfg.objective == "diffusion":
                return diffusion_loss(self.model, tokens, self.ids["mask"], generator, prompt_lengths, self.cfg.stratified_t)
            if self.cfg.objective == "block-diffusion":
                return self._block_loss(tokens, generator, prompt_lengths, self.cfg.certainty_weight)
            return ar_loss(self.model, tokens, generator, prompt_lengths)

    def _block_loss(self, tokens, generator, prompt_lengths=None, certainty_weight: float = 0.0) -> torch.Tensor:
        cfg = self.cfg
        return block_diffusion_loss(self.model, tokens, self.ids["mask"], cfg.block_size, generator, prompt_lengths,
                                    cfg.complementary_masks, (cfg.mask_ratio_min, cfg.mask_ratio_max),
                                    certainty_weight)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out NLL per token in nats (diffusion: the ELBO bound, 8 Monte-Carlo samples;
        block-diffusion: the masked tokens' cross-entropy at the training mask ratios, fixed draws)."""
        self.model.eval()
        generator = torch.Generator().manual_seed(1234)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
            if self.cfg.objective == "diffusion":
                nll = diffusion_nll_bound(self.model, self.eval_batch, self.ids["mask"], 8, generator)
                per_token = nll.sum() / self.eval_batch.numel()
            elif self.cfg.objective == "block-diffusion":
                per_token = self._block_loss(self.eval_batch, generator)
            else:
                per_token = ar_nll(self.model, self.eval_batch).sum() / (self.eval_batch.numel() - len(self.eval_batch))
        self.model.train()
        return float(per_token)

    # --- resumable state: safetensors for tensors, JSON for the rest -------------------------------
    def save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()},
                  str(self.state_dir / "model.safetensors"))
        names = {id(p): n for n, p in self.model.named_parameters()}
        opt = {}
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                opt[f"{names[id(p)]}::{key}"] = value.reshape(-1) if value.dim() == 0 else value
        save_file(opt, str(self.state_dir / "optimizer.safetensors"))
        (self.state_dir / "state.json").write_text(json.dumps(
            {"step": self.step, "tokens_seen": self.tokens_seen, "config": asdict(self.cfg), "log": self.log}))
        self.tok.save(str(self.state_dir / "tokenizer.json"))

    def load_state(self) -> None:
        state = json.loads((self.state_dir / "state.json").read_text())
        self.tok = Tokenizer.from_file(str(self.state_dir / "tokenizer.json"))
        self.model.load_state_dict(load_file(str(self.state_dir / "model.safetensors")))
        opt = load_file(str(self.state_dir / "optimizer.safetensors"))
        for name, p in self.model.named_parameters():
            entries = {k.split("::")[1]: v for k, v in opt.items() if k.split("::")[0] == name}
            if entries:
                self.optimizer.state[p] = {k: v.reshape(()) if k == "step" else v for k, v in entries.items()}
        self.step, self.tokens_seen, self.log = state["step"], state["tokens_seen"], state["log"]

    def train(self, resume: bool = False) -> Path:
        cfg = self.cfg
        if resume and (self.state_dir / "state.json").is_file():
            self.load_state()
        self.model.train()
        bar = tqdm(total=cfg.total_steps, initial=self.step, desc=f"train {cfg.objective}", unit="step",
                   dynamic_ncols=True)
        window_start, window_tokens = time.perf_counter(), 0
        while self.step < cfg.total_steps:
            tokens, prompt_lengths = self.batch(self.step)
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(cfg, self.step)
            loss = self.loss(tokens, generator, prompt_lengths)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
            self.step += 1
            self.tokens_seen += tokens.numel()
            window_tokens += tokens.numel()
            rate = window_tokens / (time.perf_counter() - window_start)
            entry = {"step": self.step, "tokens": self.tokens_seen, "loss": round(loss.item(), 4),
                     "lr": learning_rate(cfg, self.step - 1), "tokens_per_s": round(rate, 1)}
            if self.step % cfg.eval_every == 0 or self.step == cfg.total_steps:
                entry["held_out_nll"] = round(self.evaluate(), 4)
            self.log.append(entry)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", tok_s=f"{rate:.0f}",
                            **({"held_out": entry["held_out_nll"]} if "held_out_nll" in entry else {}))
            bar.update(1)
            if self.step % cfg.save_every == 0:
                self.save_state()
        bar.close()
        self.save_state()
        return self.export()

    def export(self) -> Path:
        """The final checkpoint (bf16 safetensors in the family layout), tokenizer, log and data split."""
        save_checkpoint(self.model, self.out, dtype=torch.bfloat16)
        bpe.save_tokenizer(self.tok, self.out)
        with open(self.out / "train_log.jsonl", "w") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in self.log)
        split = {"corpus": self.cfg.corpus, "held_out_percent": 5,
                 "train": [f.rel for f in self.files if not f.is_held_out],
                 "held_out": [f.rel for f in self.files if f.is_held_out]}
        (self.out / "data_split.json").write_text(json.dumps(split, indent=1) + "\n")
        config = asdict(self.cfg)  # paths as a user types them in a checkout (model cards quote them)
        config.update({k: portable_path(config[k]) for k in PATH_KNOBS if config.get(k)})
        (self.out / "train_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return self.out
