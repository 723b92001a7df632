"""Shared fixtures: tiny checkpoints written in each family's real layout."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kstep.random_checkpoint import write_random_checkpoint

# 2 threads on the 2-core CI machine; 1 when something else (a training run) shares the cores.
torch.set_num_threads(int(os.environ.get("KSTEP_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def llada_path(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llada"), family="llada", seed=1)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llama"), family="llama", seed=2)


def copy_checkpoint(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of a checkpoint with some config.json keys changed (None deletes the key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst
