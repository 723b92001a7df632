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


GGUF_REPO = "kstep-test/tiny-ar-GGUF"


@pytest.fixture
def gguf_hub_cache(tmp_path):
    """A cached repository of GGUF files only (default-ar in F32 and Q8_0), as a GGUF repo on the hub is."""
    import gguf
    from gguf_files import write_gguf
    snapshot = tmp_path / "hub" / f"models--{GGUF_REPO.replace('/', '--')}" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    write_gguf(BUNDLED_DIR / "default-ar", snapshot / "tiny-ar-F32.gguf", "llama")
    write_gguf(BUNDLED_DIR / "default-ar", snapshot / "tiny-ar-Q8_0.gguf", "llama", gguf.GGMLQuantizationType.Q8_0)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def test_a_gguf_repository_gives_the_file_its_quant_names(gguf_hub_cache, monkeypatch):
    """`org/name:QUANT` as llama.cpp's -hf takes it: the file carrying the quant; no quant and no Q4_K_M
    (llama.cpp's default): the first file; a repository without config.json is read as GGUF files."""
    import huggingface_hub.constants
    from kstep.gguf.view import gguf_source
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(gguf_hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for model_id, name in ((f"{GGUF_REPO}:Q8_0", "tiny-ar-Q8_0.gguf"), (f"{GGUF_REPO}:q8_0@{COMMIT}", "tiny-ar-Q8_0.gguf"),
                           (GGUF_REPO, "tiny-ar-F32.gguf")):
        assert gguf_source(kstep.load(model_id).path).name == name
    assert greedy(kstep.load(GGUF_REPO)) == greedy(kstep.load("default-ar"))  # F32: the same tokens
    with pytest.raises(FileNotFoundError, match=r"no GGUF file for Q5_K_M \(there: tiny-ar-F32.gguf, tiny-ar-Q8_0"):
        kstep.load(f"{GGUF_REPO}:Q5_K_M")


def test_picking_a_gguf_file_as_llama_cpp_does():
    from kstep.hub import NoSuchFile, pick_gguf
    names = ["README.md", "m-Q4_K_S.gguf", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf", "sub/m-IQ4_XS.gguf"]
    assert pick_gguf("x", names, None) == "m-Q4_K_M.gguf"
    assert pick_gguf("x", names, "q4_k_s") == "m-Q4_K_S.gguf"
    assert pick_gguf("x", names, "IQ4_XS") == "sub/m-IQ4_XS.gguf"
    assert pick_gguf("x", ["b-Q8_0.gguf", "a-Q6_K.gguf"], None) == "a-Q6_K.gguf"  # no Q4_K_M: the first
    with pytest.raises(NoSuchFile, match="split GGUF"):
        pick_gguf("x", ["big-Q4_K_M-00001-of-00002.gguf", "big-Q4_K_M-00002-of-00002.gguf"], None)
    with pytest.raises(NoSuchFile, match="no GGUF files"):
        pick_gguf("x", ["README.md"], None)


def test_a_cached_quant_is_found_offline_though_the_hub_listed_others(gguf_hub_cache, monkeypatch):
    """huggingface_hub remembers a repository's file list from an online call; offline, a snapshot
    missing the quants never fetched is "incomplete" to it, yet holds the one asked for."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    import huggingface_hub.constants
    from kstep.gguf.view import gguf_source
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(gguf_hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    entry = dict(size=4, blob_id="x", lfs_sha256=None, lfs_size=None, xet_hash=None)
    listed = {name: tree_cache.TreeCacheEntry(**entry) for name in ("tiny-ar-F32.gguf", "tiny-ar-Q8_0.gguf",
                                                                    "tiny-ar-Q4_K_M.gguf", "README.md")}
    tree_cache.write_tree_cache(str(gguf_hub_cache / f"models--{GGUF_REPO.replace('/', '--')}"), COMMIT, listed)
    assert gguf_source(kstep.load(f"{GGUF_REPO}:Q8_0").path).name == "tiny-ar-Q8_0.gguf"
