"""How a family's checkpoint tensors map onto kstep's parameters, when not one to one: stacked
experts from per-expert tensors, q/k/v from a fused projection (read by kstep/weights.py)."""
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Part:
    """Where a checkpoint tensor, or a run of its rows, goes in a parameter: `index` into the
    parameter (one expert's slot of a stacked weight), `rows` of the tensor (a fused q/k/v
    projection split into q, k and v; a tensor-parallel rank's share), `cols` of it (a row-parallel
    rank's share), `transpose`: the parameter holds the tensor's last two dims swapped (experts
    kept in the (in, out) layout)."""
    tensor: str
    index: tuple = ()
    rows: tuple[int, int] | None = None
    transpose: bool = False
    cols: tuple[int, int] | None = None


NameMap = dict[str, "str | list[Part]"]  # parameter -> the checkpoint tensor (or the parts) it holds


def parts_of(names: NameMap) -> dict[str, list[Part]]:
    return {ours: [Part(theirs)] if isinstance(theirs, str) else theirs for ours, theirs in names.items()}
