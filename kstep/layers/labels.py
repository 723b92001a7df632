"""Profiler labels for `kstep bench compare`'s time breakdown (attention, LM head), free when no
profiler is running: a record_function costs tens of microseconds per pass otherwise."""
from contextlib import nullcontext

import torch
from torch.profiler import record_function

_NO_LABEL = nullcontext()


def labelled(name: str):
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_LABEL
