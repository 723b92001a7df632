"""Hugging Face ids as models (issue 46): an id resolves through huggingface_hub from the cache layout
it writes (models--org--name/snapshots/REV, refs/main), by name or at a revision, in Python and on the
command line offline; an id neither cached nor reachable fails naming it; only the files kstep reads
are ever asked for."""
import fnmatch
import os
import shutil
import subprocess
import sys

import pytest

import kstep
from kstep.bundled import BUNDLED_DIR
from kstep.hub import FILES

REPO, COMMIT = "kstep-test/tiny-ar", "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["def add(a, b):", "import os\n"]


@pytest.fixture
def hub_cache(tmp_path):
    """A Hugging Face cache holding default-ar as REPO at COMMIT, laid out as huggingface_hub lays it out."""
    folder = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_DIR / "default-ar" / name, snapshot / name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def greedy(llm):
    return [r.token_ids for r in llm.generate(PROMPTS, max_tokens=12, temperature=0.0)]


def test_an_id_resolves_from_the_cache_by_name_and_at_a_revision(hub_cache, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    want = greedy(kstep.load("default-ar"))
    for model_id in (REPO, f"{REPO}@{COMMIT}"):
        llm = kstep.load(model_id)
        assert llm.path.parent.name == "snapshots" or llm.path.name == COMMIT
        assert greedy(llm) == want


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kstep", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_the_cli_runs_a_cached_id_offline(hub_cache):
    env = dict(HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    by_id = cli("generate", PROMPTS[0], "--model", REPO, "--max-tokens", "12", "--temperature", "0", **env)
    bundled = cli("generate", PROMPTS[0], "--model", "default-ar", "--max-tokens", "12", "--temperature", "0")
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout == bundled.stdout


@pytest.mark.parametrize("env,needle", [
    (dict(HF_HUB_OFFLINE="1"), "not in the Hugging Face cache and HF_HUB_OFFLINE is set"),
    (dict(HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9"), "neither in the Hugging Face cache nor downloadable"),
])
def test_an_id_neither_cached_nor_reachable_fails_naming_it(hub_cache, env, needle):
    done = cli("generate", "x", "--model", "kstep-test/not-cached", HF_HUB_CACHE=str(hub_cache), **env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "'kstep-test/not-cached'" in done.stderr and needle in done.stderr, done.stderr


def test_only_the_files_kstep_reads_are_asked_for():
    wanted = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
              "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    never = ["pytorch_model.bin", "model.pt", "modeling_llada.py", "configuration_llada.py", "optimizer.pkl",
             "training_args.bin", "model.ckpt"]
    assert all(any(fnmatch.fnmatch(name, p) for p in FILES) for name in wanted)
    assert not any(fnmatch.fnmatch(name, p) for name in never for p in FILES)
