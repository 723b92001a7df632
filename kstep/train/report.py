"""`kstep train-report`: training curves, held-out metrics, side-by-side samples and model cards
for a trained diffusion / AR pair.

Metrics are per token in nats on the held-out split: the AR model's NLL, and for the diffusion
model the Monte-Carlo ELBO bound on its NLL (LLaDA's `get_log_likelihood`), on the same windows.
"""
import json
import sys
import time
from pathlib import Path

import torch

import kstep
from kstep.params import BLOCK_DIFFUSION, DIFFUSION
from kstep.train import data
from kstep.train.block_objective import block_diffusion_loss
from kstep.train.corpus import function_examples
from kstep.train.objectives import ar_nll, diffusion_nll_bound
from kstep.train.paths import PATH_KNOBS, portable_path
from kstep.weights import read_json

OBJECTIVE_TEXT = {
    "diffusion": "LLaDA masked diffusion: t ~ U(eps, 1], mask w.p. t, CE on masks / t",
    "block-diffusion": "block diffusion (BD3-LM [noisy; clean], per-block mask ratios, complementary masks, "
                       "shifted logits), CE on masks",
    "ar": "next-token cross-entropy",
}

SAMPLE_TOKENS = 64


def read_log(model_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (model_dir / "train_log.jsonl").read_text().splitlines()]


def plot_curves(runs: dict[str, Path], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, model_dir), color in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green")):
        log = read_log(model_dir)
        tokens = [e["tokens"] / 1e6 for e in log]
        losses = [e["loss"] for e in log]
        window = 25
        smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                  for i in range(len(losses))]
        ax.plot(tokens, smooth, color=color, label=f"{label}: train loss (mean of {window} steps)")
        held = [(e["tokens"] / 1e6, e["held_out_nll"]) for e in log if "held_out_nll" in e]
        if held:
            kind = kstep.load(model_dir).kind
            name = {DIFFUSION: "NLL (ELBO bound)", BLOCK_DIFFUSION: "masked-token CE"}.get(kind, "NLL")
            ax.plot(*zip(*held), "o--", color=color, markersize=4, label=f"{label}: held-out {name}")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("nats per token")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Training curves: " + " vs ".join(runs))
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def held_out_windows(model_dir: Path, seq_len: int, count: int) -> torch.Tensor:
    split = read_json(model_dir / "data_split.json")
    files = [f for f in data.corpus_files(split["corpus"]) if f.rel in set(split["held_out"])]
    llm_tok = kstep.load(model_dir).tokenizer
    stream = data.tokenize(llm_tok._tok, data.texts(files), llm_tok.special_id("eos_token"))
    return data.fixed_windows(stream, count, seq_len)


def held_out_nll(model_dir: Path, windows: torch.Tensor, mc_samples: int) -> float:
    return held_out_nll_of(kstep.load(model_dir), windows, mc_samples)


@torch.no_grad()
def held_out_nll_of(llm, windows: torch.Tensor, mc_samples: int) -> float:
    """Per-token held-out NLL (AR) or its upper bound (diffusion, Monte-Carlo ELBO) of a loaded model;
    a block-diffusion model: the masked tokens' cross-entropy of its training objective (fixed draws),
    not a likelihood."""
    if llm.kind == BLOCK_DIFFUSION:
        loss = block_diffusion_loss(llm.model, windows, llm.cfg.mask_token_id, llm.cfg.block_size,
                                    torch.Generator().manual_seed(0))
        return float(loss)
    if llm.is_diffusion:
        nll = diffusion_nll_bound(llm.model, windows, llm.cfg.mask_token_id, mc_samples,
                                  torch.Generator().manual_seed(0))
        return float(nll.sum() / windows.numel())
    return float(ar_nll(llm.model, windows).sum() / (windows.numel() - len(windows)))


def samples(runs: dict[str, Path], count: int) -> list[dict]:
    split = read_json(next(iter(runs.values())) / "data_split.json")
    files = [f for f in data.corpus_files(split["corpus"]) if f.rel in set(split["held_out"])]
    examples = [e for e in function_examples(files) if len(e.prompt) < 400][:count]
    rows = [{"function": f"{e.file}:{e.name}", "prompt": e.prompt, "reference": e.body} for e in examples]
    for label, model_dir in runs.items():
        llm = kstep.load(model_dir)
        for row in rows:
            [result] = llm.generate(row["prompt"], max_tokens=SAMPLE_TOKENS)
            row[label] = {"text": result.text, "nfe": result.nfe, "seconds": round(result.seconds, 2)}
    return rows


def reproduce_command(cfg: dict) -> str:
    """The `kstep train` command line that made a model, from its train_config.json."""
    from kstep.train.trainer import TrainConfig
    defaults = {name: f.default for name, f in TrainConfig.__dataclass_fields__.items()}
    parts = ["kstep train", f"--objective {cfg['objective']}", f"--out {portable_path(cfg['out'])}"]
    for name, value in cfg.items():
        if name not in defaults or name in ("objective", "out") or value == defaults[name]:
            continue
        if name in PATH_KNOBS:
            value = portable_path(value)
        flag = "--" + name.replace("_", "-")
        parts.append(flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}")
    return " ".join(parts)


def write_model_card(model_dir: Path, title: str, metrics: dict) -> None:
    cfg = read_json(model_dir / "train_config.json")
    script = ("scripts/train_block_coder.sh  # every stage, the distilled data and this report"
              if cfg["objective"] == "block-diffusion" else
              "scripts/train_default_models.sh  # the pair, the draft and this report")
    reproduce = f"{reproduce_command(cfg)}\n# or\n{script}"
    (model_dir / "README.md").write_text(model_card(model_dir, title, metrics, reproduce))


def model_card(model_dir: Path, title: str, metrics: dict, reproduce: str) -> str:
    cfg = read_json(model_dir / "train_config.json")
    log = read_log(model_dir)
    llm = kstep.load(model_dir)
    wall = log[-1]["tokens"] / log[-1]["tokens_per_s"] / 60  # the run's average rate (evaluations excluded)
    corpus = (f"the Python {'.'.join(map(str, sys.version_info[:2]))} standard library, no tests / vendored code / "
              "generated tables" if cfg["corpus"] == "stdlib" else f"the .py/.txt files under `{cfg['corpus']}`")
    size_mib = (model_dir / "model.safetensors").stat().st_size / 2**20
    origin = (f"Trained on this project's machines with `kstep train`, from `{Path(cfg['init_from']).name}`'s "
              "weights (see Reproduce)" if cfg.get("init_from") else
              "Trained from scratch on this project's machines with `kstep train`")
    objective = OBJECTIVE_TEXT[cfg["objective"]]
    if cfg.get("certainty_weight"):
        objective += f", plus {cfg['certainty_weight']} x dParallel's certainty forcing"
    if cfg.get("distill_data"):
        corpus += (f"; {1 - cfg['real_data_fraction']:.0%} of the rows are the AR twin's greedy completions of "
                   "training-split function prompts, kept when they parse (`kstep distill`)")
    gen_path = model_dir / "generation_config.json"
    decoding = (f"| decoding defaults | `generation_config.json`: "
                f"{', '.join(f'{k} {v}' for k, v in read_json(gen_path).items())} |\n" if gen_path.is_file() else "")
    return f"""# {title}

{origin}. Small and weak by design: it exists so that kstep works offline out of the box and so
that the diffusion and AR paths can be compared on equal terms (same size, tokenizer and data).
Do not expect useful code.

| | |
|---|---|
| objective | {cfg['objective']} ({objective}) |
| layout | `{llm.cfg.family}` ({llm.cfg.attention}), {llm.cfg.num_params / 1e6:.2f} M parameters, d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, SwiGLU {cfg['ffn_dim']}, untied head |
| weights | bfloat16 safetensors, {size_mib:.1f} MiB |
| tokenizer | byte-level BPE, {llm.cfg.vocab_size} tokens, trained on the training split (special: `<\\|pad\\|>`, `<\\|endoftext\\|>`, `<\\|mask\\|>`) |
| data | {corpus}; split by file (5% held out, `data_split.json`) |
| budget | {log[-1]['tokens'] / 1e6:.2f} M tokens ({len(log)} steps of {cfg['batch_size']} x {cfg['seq_len']}), about {wall:.0f} min at {cfg['threads'] or 'all'} thread(s) on 2 CPU cores (AdamW, lr {cfg['lr']}, warmup {cfg['warmup_steps']}, cosine to {cfg['min_lr_ratio']}x) |
| context | trained on {cfg['seq_len']}-token windows: longer canvases are out of distribution |
| held-out | {', '.join(f'{k}: {v:.3f}' for k, v in metrics.items())} nats/token |
{decoding}
Reproduce:

```bash
{reproduce}
```

Files: `train_log.jsonl` (loss, learning rate, tokens/s per step; held-out NLL every
{cfg['eval_every']} steps), `train_config.json`, `data_split.json`.
"""


def write_report(runs: dict[str, Path], out: Path, mc_samples: int = 16, windows: int = 64,
                 num_samples: int = 3) -> dict:
    """Curves PNG, metrics and samples JSON, and a Markdown section; returns the metrics."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    plot_curves(runs, out / "training_curves.png")
    first = next(iter(runs.values()))
    seq_len = read_json(first / "train_config.json")["seq_len"]
    batch = held_out_windows(first, seq_len, windows)
    metrics = {label: held_out_nll(path, batch, mc_samples) for label, path in runs.items()}
    rows = samples(runs, num_samples)
    result = {"held_out_nll_per_token": metrics, "held_out_windows": len(batch), "seq_len": seq_len,
              "mc_samples": mc_samples, "samples": rows, "seconds": round(time.time() - start, 1)}
    (out / "training_report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
