"""`kstep serve --model` values: `[NAME=]MODEL[:KEY=VALUE,...]`, one per served model.

MODEL is a bundled name or a checkpoint directory; NAME is what clients send as `model` (default:
MODEL as given); the options are this model's own `draft=` (a draft model or `ngram`), `quantize=`
(int8, int4) and decoding defaults (any per-model knob of `kstep serve`, e.g. `exact=true`,
`threshold=0.8`, `max-tokens` excepted), over the flags given for every model. No torch here."""
import types
from dataclasses import dataclass, field

from kstep.params import GenerationParams, user_knobs

LOAD_OPTIONS = ("draft", "quantize", "tp")
QUANTIZE_CHOICES = ("int8", "int4")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    model: str
    draft: str | None = None
    quantize: str | None = None
    defaults: dict = field(default_factory=dict)   # GenerationParams fields
    tensor_parallel_size: int | None = None        # `tp=N`: this model over N ranks
    text: str = field(default="", compare=False)   # the --model value as given (for messages)


def _knob_types() -> dict[str, type]:
    out = {}
    for f in user_knobs():
        if not f.metadata["server_default"]:
            continue
        kind = f.type
        if isinstance(kind, types.UnionType):
            kind = next(a for a in kind.__args__ if a is not type(None))
        out[f.name] = kind
    return out


def _value(spec: str, key: str, text: str, kind: type):
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"--model {spec!r}: {key} must be true or false, got {text!r}")
        return text.lower() == "true"
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--model {spec!r}: {key} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {text!r}") from None


def parse_model_spec(spec: str) -> ModelSpec:
    """One `--model` value -> ModelSpec; a bad option is an error naming it and the rule."""
    head, _, options = spec.partition(":")
    name, _, model = head.partition("=") if "=" in head else (head, "", head)
    if not name or not model:
        raise ValueError(f"--model {spec!r}: give MODEL or NAME=MODEL, then optionally :KEY=VALUE,...")
    load, defaults, knobs = {}, {}, _knob_types()
    for item in filter(None, (o.strip() for o in options.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not text:
            raise ValueError(f"--model {spec!r}: option {item!r} must be KEY=VALUE")
        if key in LOAD_OPTIONS:
            if key == "quantize" and text not in QUANTIZE_CHOICES:
                raise ValueError(f"--model {spec!r}: quantize must be one of {', '.join(QUANTIZE_CHOICES)}, "
                                 f"got {text!r}")
            if key == "tp" and not (text.isdigit() and int(text) >= 1):
                raise ValueError(f"--model {spec!r}: tp must be a positive integer, got {text!r}")
            load[key] = text
        elif key in knobs:
            defaults[key] = _value(spec, key, text, knobs[key])
        else:
            known = ", ".join(list(LOAD_OPTIONS) + sorted(knobs))
            raise ValueError(f"--model {spec!r}: unknown option {key!r} (known: {known})")
    GenerationParams(**defaults)  # a bad value fails now, naming it
    tp = int(load["tp"]) if "tp" in load else None
    return ModelSpec(name, model, load.get("draft"), load.get("quantize"), defaults, tp, spec)
