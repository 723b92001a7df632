"""`kstep train` (flags generated from TrainConfig) and `kstep train-report`."""
import argparse
import json
from pathlib import Path

from kstep.flags import add_command


def add_train(sub) -> None:
    from kstep.train.config import OBJECTIVES, TrainConfig
    train = add_command(sub, "train", "train a diffusion (llada), block-diffusion or AR (llama) model on a code corpus")
    for f in TrainConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("objective", "out"):
            train.add_argument(flag, required=True, choices=OBJECTIVES if f.name == "objective" else None)
        elif f.type is bool:
            train.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {int | None: int, str | None: str}.get(f.type, f.type)
            train.add_argument(flag, type=kind, default=f.default)
    train.add_argument("--resume", action="store_true", help="continue from OUT/train_state if present")
    train.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from kstep.train.trainer import TrainConfig, Trainer
    fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
    print(Trainer(TrainConfig(**fields)).train(resume=args.resume))
    return 0


def add_distill(sub) -> None:
    distill = add_command(sub, "distill", "an AR teacher's greedy completions of the training prompts (JSONL), "
                                          "for training a diffusion student")
    distill.add_argument("--model", default="default-ar", help="the teacher (an AR checkpoint)")
    distill.add_argument("--out", required=True, help="JSONL to append to (a stopped run resumes)")
    distill.add_argument("--max-tokens", type=int, default=192)
    distill.add_argument("--batch-size", type=int, default=16)
    distill.add_argument("--limit", type=int, default=None, help="at most this many prompts")
    distill.add_argument("--corpus", default="stdlib")
    distill.add_argument("--threads", type=int, default=None)
    distill.set_defaults(run=run_distill)


def run_distill(args: argparse.Namespace) -> int:
    from kstep.flags import check_positive, set_threads
    from kstep.train.distill import distill
    check_positive(args, "max_tokens", "batch_size")
    set_threads(args.threads)
    print(distill(args.model, Path(args.out), args.max_tokens, args.batch_size, args.limit, args.corpus))
    return 0


def add_train_report(sub) -> None:
    report = add_command(sub, "train-report", "curves, held-out metrics and samples for trained models")
    report.add_argument("--model", action="append", required=True, metavar="LABEL=DIR",
                        help="a trained model directory with a label (repeat; the first sets the held-out windows)")
    report.add_argument("--out", required=True, help="where training_curves.png and training_report.json go")
    report.add_argument("--mc-samples", type=int, default=16, help="Monte-Carlo samples for the diffusion bound")
    report.add_argument("--windows", type=int, default=64, help="held-out windows to score")
    report.add_argument("--write-cards", action="store_true", help="also write a README.md model card per model")
    report.set_defaults(run=run_train_report)


def run_train_report(args: argparse.Namespace) -> int:
    from kstep.registry import FAMILIES
    from kstep.params import AUTOREGRESSIVE, BLOCK_DIFFUSION
    from kstep.train.report import write_model_card, write_report
    from kstep.weights import read_model_config
    runs = {}
    for item in args.model:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            raise ValueError(f"--model {item!r} must be LABEL=DIR with an existing directory")
        runs[label] = Path(path)
    result = write_report(runs, Path(args.out), args.mc_samples, args.windows)
    metrics = result["held_out_nll_per_token"]
    if args.write_cards:
        for label, path in runs.items():
            kind = FAMILIES[read_model_config(path).family].kind
            name = {AUTOREGRESSIVE: "NLL", BLOCK_DIFFUSION: "masked-token CE of its objective (not a likelihood)"}.get(
                kind, "NLL bound (ELBO)")
            write_model_card(path, f"kstep bundled model: {label} ({path.name})",
                             {name: v for lab, v in metrics.items() if lab == label})
    print(json.dumps(metrics))
    return 0
