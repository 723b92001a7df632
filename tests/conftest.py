"""Shared fixtures: tiny checkpoints written in each family's real layout."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from kstep.bench.server_process import running_server
from kstep.random_checkpoint import write_random_checkpoint

# 2 threads on the 2-core CI machine; 1 when something else (a training run) shares the cores.
torch.set_num_threads(int(os.environ.get("KSTEP_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def llada_path(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llada"), family="llada", seed=1)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("llama"), family="llama", seed=2)


@pytest.fixture(scope="session")
def v2_path(tmp_path_factory) -> Path:
    """A tiny Fast-dLLM v2 checkpoint. The published config has no mask id (its samplers default to
    |<MASK>|); kstep reads one from config.json or the tokenizer; this one has no tokenizer, so it is
    in config.json."""
    from block_reference import MASK_ID, write_fast_dllm_v2_checkpoint
    return write_fast_dllm_v2_checkpoint(tmp_path_factory.mktemp("v2"), mask_token_id=MASK_ID)


@pytest.fixture(scope="session")
def sdar_path(tmp_path_factory) -> Path:
    from block_reference import write_sdar_checkpoint
    return write_sdar_checkpoint(tmp_path_factory.mktemp("sdar"))


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory) -> Path:
    """A tiny DiffusionGemma checkpoint written by transformers (tests/gemma_reference.py)."""
    from gemma_reference import write_gemma_checkpoint
    return write_gemma_checkpoint(tmp_path_factory.mktemp("gemma"))[0]


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


@pytest.fixture(scope="module")
def llada_server(llada_path, tmp_path_factory):
    """A real `kstep serve` of the tiny LLaDA checkpoint (one per test module), served as "tiny"."""
    with running_server(llada_path, "--served-model-name", "tiny", "--max-batch-size", "8",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


@pytest.fixture(scope="module")
def llama_server(llama_path, tmp_path_factory):
    """A real `kstep serve` of the tiny LLaMA checkpoint (one per test module), served as "tiny-ar"."""
    with running_server(llama_path, "--served-model-name", "tiny-ar",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as (url, _):
        yield url


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    """A random checkpoint of a family, loaded once per test module: random_models("llada")."""
    cache = {}

    def get(family: str):
        import kstep
        if family not in cache:
            cache[family] = kstep.load(write_random_checkpoint(tmp_path_factory.mktemp(family), family=family, seed=5))
        return cache[family]
    return get


def ar_masked_block_models(tmp_path_factory) -> list[str]:
    """`kstep serve` arguments for random AR ("ar"), masked-diffusion ("masked") and block-diffusion
    ("block") models in one server."""
    paths = {name: write_random_checkpoint(tmp_path_factory.mktemp(name), family=family, seed=3)
             for name, family in (("ar", "qwen2"), ("masked", "llada"), ("block", "sdar"))}
    return [f"ar={paths['ar']}", "--model", f"masked={paths['masked']}", "--model", f"block={paths['block']}"]
