"""Loading the models a server serves: each on its own torch thread (`torch_thread`), which then
runs every step of its engine, with its decoding defaults resolved against its family. Used by
`kstep serve` in one process and by each Ray Serve replica (replicas.py)."""
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


def load_served_models(specs: list[ModelSpec], options: LoadOptions, announce: str | None = None) -> list:
    import torch

    from kstep.engine.async_engine import torch_thread
    from kstep.llm import load
    from kstep.params import SELF_DRAFT, knob_applies
    from kstep.server.app import ServedModel

    def load_model(spec: ModelSpec):
        if options.threads is not None:  # OpenMP's thread count is per thread: set it where torch runs
            torch.set_num_threads(options.threads)
        draft = None if (spec.draft or options.draft) == SELF_DRAFT else spec.draft or options.draft
        return load(spec.model, device=options.device, dtype=options.dtype, draft=draft,
                    quantize=spec.quantize or options.quantize,
                    tensor_parallel_size=spec.tensor_parallel_size or options.tensor_parallel_size,
                    distributed_executor_backend=options.distributed_executor_backend)
    served = []
    for spec in specs:
        executor = torch_thread()  # each model's engine steps on its own thread
        llm = executor.submit(load_model, spec).result()
        own = {**spec.defaults, **({"draft": SELF_DRAFT} if (spec.draft or options.draft) == SELF_DRAFT else {})}
        for k in own:  # draft self: a decoding default (the model drafts for itself), not a model to load
            if not knob_applies(k, llm.cfg.family, llm.kind):
                raise ValueError(f"--model {spec.name}: {k} does not apply to a {llm.cfg.family} model")
        defaults = {k: v for k, v in options.shared_defaults.items() if knob_applies(k, llm.cfg.family, llm.kind)}
        served.append(ServedModel(spec.name, llm, {**defaults, **own}, executor))
        if announce is not None:
            print(f"kstep serve: {spec.name} ({llm.kind}, {llm.path}) {announce}", file=sys.stderr, flush=True)
    return served
