"""Loading the models a server serves: each on its own torch thread (`torch_thread`), which then
runs every step of its engine, with its decoding defaults resolved against its family. Used by
`kstep serve` in one process and by each Ray Serve replica (replicas.py). Every spec is checked
against its checkpoint's config and this machine (`check_specs`) before any model loads, so a
bad second spec is refused before the first model takes minutes to load."""
import sys
from dataclasses import dataclass, field

from kstep.server.model_specs import ModelSpec


@dataclass(slots=True, frozen=True)
class LoadOptions:
    """What every served model is loaded with (a spec's own draft / quantize win)."""
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    draft: str | None = None
    quantize: str | None = None
    shared_defaults: dict = field(default_factory=dict)   # decoding defaults for every model that takes them
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"              # ranks 1..N-1 as processes ("mp") or Ray actors ("ray")
    kv_cache_memory: str | None = None                    # each model's KV pool (runner/memory_budget.py)
    memory_utilization: float | None = None


def check_spec(spec: ModelSpec, options: LoadOptions) -> None:
    """What can be known of one served model before loading it: its checkpoint is there and of a
    known family, its tensor-parallel size fits this machine (processes; Ray's resources decide
    for its actors) and divides the model, its draft and knobs suit its family; else a ValueError."""
    import torch

    from kstep.bundled import resolve_model
    from kstep.decoding.drafters import NGRAM
    from kstep.distributed.launch import check_size, check_supported
    from kstep.params import AUTOREGRESSIVE, SELF_DRAFT, knob_applies
    from kstep.registry import FAMILIES
    from kstep.weights import read_model_config

    cfg = read_model_config(resolve_model(spec.model))
    family = FAMILIES[cfg.family]
    size = spec.tensor_parallel_size or options.tensor_parallel_size
    quantize, draft = spec.quantize or options.quantize, spec.draft or options.draft
    if size > 1:
        check_size(size, torch.device(options.device), options.distributed_executor_backend)
        check_supported(cfg, size)
        if quantize is not None:
            raise ValueError(f"quantize {quantize!r} with tensor_parallel_size {size}: weight-only quantization runs "
                             "on one device only")
    if draft == NGRAM and family.kind != AUTOREGRESSIVE:
        raise ValueError(f"draft {NGRAM!r} needs an autoregressive model, not {cfg.family}")
    if draft not in (None, NGRAM, SELF_DRAFT):  # a draft model: there, and both AR (its vocabulary: at load)
        draft_cfg = read_model_config(resolve_model(draft))
        if family.kind != AUTOREGRESSIVE or FAMILIES[draft_cfg.family].kind != AUTOREGRESSIVE:
            raise ValueError(f"draft {draft!r}: speculative decoding needs an autoregressive target and draft "
                             f"({cfg.family}, draft {draft_cfg.family})")
    own = {**spec.defaults, **({"draft": SELF_DRAFT} if draft == SELF_DRAFT else {})}
    for k in own:  # draft self: a decoding default (the model drafts for itself), not a model to load
        if not knob_applies(k, cfg.family, family.kind):
            raise ValueError(f"{k} does not apply to a {cfg.family} model")


def check_specs(specs: list[ModelSpec], options: LoadOptions) -> None:
    """Every spec checked (check_spec), before anything loads or is printed: a ValueError naming the bad one."""
    for spec in specs:
        try:
            check_spec(spec, options)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--model {spec.text or spec.name!r}: {e}") from None


def load_served_models(specs: list[ModelSpec], options: LoadOptions, announce: str | None = None) -> list:
    import torch

    from kstep.engine.async_engine import torch_thread
    from kstep.llm import load
    from kstep.params import SELF_DRAFT, knob_applies
    from kstep.server.app import ServedModel
    check_specs(specs, options)

    def load_model(spec: ModelSpec):
        if options.threads is not None:  # OpenMP's thread count is per thread: set it where torch runs
            torch.set_num_threads(options.threads)
        draft = None if (spec.draft or options.draft) == SELF_DRAFT else spec.draft or options.draft
        return load(spec.model, device=options.device, dtype=options.dtype, draft=draft,
                    quantize=spec.quantize or options.quantize,
                    tensor_parallel_size=spec.tensor_parallel_size or options.tensor_parallel_size,
                    distributed_executor_backend=options.distributed_executor_backend,
                    kv_cache_memory=options.kv_cache_memory, memory_utilization=options.memory_utilization)
    served = []
    for spec in specs:
        executor = torch_thread()  # each model's engine steps on its own thread
        llm = executor.submit(load_model, spec).result()
        # draft self: a decoding default (the model drafts for itself), not a model to load
        own = {**spec.defaults, **({"draft": SELF_DRAFT} if (spec.draft or options.draft) == SELF_DRAFT else {})}
        defaults = {k: v for k, v in options.shared_defaults.items() if knob_applies(k, llm.cfg.family, llm.kind)}
        served.append(ServedModel(spec.name, llm, {**defaults, **own}, executor))
    for model in served if announce is not None else []:  # once all are loaded: a load failure prints none
        print(f"kstep serve: {model.name} ({model.llm.kind}, {model.llm.path}) {announce}", file=sys.stderr,
              flush=True)
    return served
