"""argparse pieces every `kstep` command shares: the generation knobs' flags, generated from their
declaration in GenerationParams (kstep/params/generation.py), device/dtype flags, and list parsing. Bad values
are errors that name the flag and the rule."""
import argparse
import types

from kstep.params import GenerationParams, user_knobs

DEVICES = ("cpu", "cuda")
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # kstep.weights.DTYPES, without importing torch here


def add_command(sub, name: str, help: str, usage_args: str = "") -> argparse.ArgumentParser:
    """A sub-command whose error usage line stays one short line."""
    prog = f"{sub._prog_prefix} {name}"
    return sub.add_parser(name, help=help, description=help, prog=prog,
                          usage=f"{prog} [options] {usage_args}".rstrip())


def _base_type(annotation):
    if isinstance(annotation, types.UnionType):
        return next(a for a in annotation.__args__ if a is not type(None))
    return annotation


def add_knob_flags(parser: argparse.ArgumentParser, server_defaults: bool = False) -> None:
    """One flag per generation knob (`--max-tokens`, `--threshold`, ...; `--no-early-stop` for a knob
    that defaults to true). Every flag defaults to None: only the flags given are passed on, so each
    default lives in GenerationParams alone. `server_defaults`: only the knobs a server sets per model."""
    for f in user_knobs():
        meta = f.metadata
        if (server_defaults and not meta["server_default"]) or not meta["flag"]:
            continue
        families = f" [{' / '.join(meta['families'])}]" if meta["families"] else ""
        help_text = meta["help"] + families
        kind = _base_type(f.type)
        if kind is bool and f.default:
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const", const=False,
                                default=None, help="do not: " + help_text)
        elif kind is bool:
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, action="store_const", const=True,
                                default=None, help=help_text)
        else:
            choices = list(meta["choices"]) if meta["choices"] else None
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, choices=choices,
                                default=None, help=help_text)


def knobs_given(args: argparse.Namespace) -> dict:
    """The generation knobs set on the command line (a knob without a flag of its own is the
    command's to map: `--draft` is a model to load, or the `draft` knob's "self")."""
    return {f.name: getattr(args, f.name) for f in user_knobs()
            if f.metadata["flag"] and getattr(args, f.name, None) is not None}


def params_from_args(args: argparse.Namespace) -> GenerationParams:
    return GenerationParams(**knobs_given(args))


def add_device_flags(parser: argparse.ArgumentParser, threads: bool = False, parallel: bool = False) -> None:
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    if parallel:
        parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                            help="split the model over N processes (tensor and expert parallel: N CUDA devices, "
                                 "or N CPU cores at one thread each); default 1")
        parser.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                            help="what runs ranks 1..N-1: processes of this machine (mp, the default) or Ray "
                                 "actors in a placement group (ray; what serve --replicas uses)")
    if threads:
        parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def add_memory_flags(parser: argparse.ArgumentParser) -> None:
    """The KV pool's budget (kstep/runner/memory_budget.py): one flag or the other, per model."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                       help="bytes of the KV pool every request's cache comes from, per model (e.g. 2GiB, 512MiB); "
                            "requests wait for its pages; one too big for it alone is refused")
    group.add_argument("--memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="size the KV pool as this fraction of the memory left once the weights are loaded "
                            "(RAM, or the GPU's; container and ulimit limits count); default 0.5, at most 32 "
                            "whole contexts")


def check_memory_flags(args: argparse.Namespace) -> None:
    """A bad size or fraction fails before any model loads, naming the flag."""
    from kstep.runner.memory_budget import parse_size
    if args.kv_cache_memory is not None:
        parse_size(args.kv_cache_memory)
    if args.memory_utilization is not None and not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization {args.memory_utilization} must be in (0, 1]")


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads <= 0:
            raise ValueError(f"--threads must be positive, got {threads}")
        import torch
        torch.set_num_threads(threads)


def positive_ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be comma-separated integers") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{flag} {text!r} must be positive integers")
    return values


def check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
