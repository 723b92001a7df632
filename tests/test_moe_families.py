"""The MoE families as checkpoints ship them: which family a config.json is, sharded safetensors
with an index, per-expert tensors stacked at load, bf16 kept bf16, mask ids where the tokenizer
files keep them, and packed batches equal to each request alone."""
import json
import shutil

import pytest
import torch

import kstep
from kstep.random_checkpoint import write_random_checkpoint
from kstep.registry import family_for
from kstep.weights import load_model, mask_id_from_tokenizer, read_model_config

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, item):", "x = [i * i for i in"]


@pytest.fixture(scope="module")
def llada2_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("llada2"), family="llada2_moe", seed=4, n_layers=3)


@pytest.fixture(scope="module")
def lladamoe_path(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("lladamoe"), family="llada_moe", seed=5, shared_dim=16)


def test_llada_and_llada_moe_share_a_model_type_and_are_told_apart_by_their_experts(lladamoe_path):
    raw = json.loads((lladamoe_path / "config.json").read_text())
    assert raw["model_type"] == "llada" and family_for(raw).name == "llada_moe"
    anonymous = {k: v for k, v in raw.items() if k != "architectures"}
    assert family_for(anonymous).name == "llada_moe"
    dense = {"model_type": "llada", "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 100}
    assert family_for(dense).name == "llada"
    assert family_for({"architectures": ["LLaDA2MoeModelLM"]}).name == "llada2_moe"
    with pytest.raises(ValueError, match="unknown architecture"):
        family_for({"architectures": ["LLaDA3ForSomething"], "model_type": "llada3"})


def test_llada2_config_follows_the_reference_class_defaults(llada2_path):
    cfg = read_model_config(llada2_path)
    assert cfg.attention == "block_causal" and cfg.block_size == 32 and cfg.rotary_width == cfg.head_dim // 2
    assert cfg.moe.router == "sigmoid_grouped" and cfg.moe.dense_layers == (0,) and cfg.moe.has_bias
    raw = json.loads((llada2_path / "config.json").read_text())
    for key in ("use_bias", "use_qk_norm", "partial_rotary_factor"):  # absent: the config class's defaults apply
        raw.pop(key)
    path = llada2_path.parent / "defaults"
    shutil.copytree(llada2_path, path, dirs_exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    cfg = read_model_config(path)
    assert cfg.out_bias and cfg.qk_norm and cfg.rotary_width == cfg.head_dim // 2
    with pytest.raises(ValueError, match="attention.dense.bias"):  # use_bias true: the dense bias must be there
        load_model(path)


@pytest.mark.parametrize("family", ["llada2_moe", "llada_moe"])
def test_sharded_checkpoint_with_an_index_loads_as_the_single_file(family, tmp_path):
    single = write_random_checkpoint(tmp_path / "single", family=family, seed=7)
    sharded = write_random_checkpoint(tmp_path / "sharded", family=family, seed=7, shard_bytes=64 * 1024)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and not (sharded / "model.safetensors").exists()
    assert all((sharded / f).is_file() for f in files) and files[0].endswith(f"-of-{len(files):05d}.safetensors")
    assert any(".experts.5.down_proj" in name for name in index["weight_map"])  # one tensor per expert
    ids, positions = torch.tensor([[5, 9, 12, 7]]), torch.arange(4)[None]
    a, b = load_model(single), load_model(sharded)
    with torch.no_grad():
        assert torch.equal(a(ids, positions), b(ids, positions))


def test_bfloat16_checkpoint_loads_as_bfloat16_with_a_float32_router_bias(tmp_path):
    path = write_random_checkpoint(tmp_path, family="llada2_moe", dtype=torch.bfloat16)
    model = load_model(path, dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["layers.1.mlp.experts.gate_up"] == torch.bfloat16
    assert dtypes["layers.1.mlp.router.bias"] == torch.float32
    assert {d for n, d in dtypes.items() if not n.endswith("router.bias")} == {torch.bfloat16}


def test_mask_id_found_in_added_tokens_json_alone(tmp_path, lladamoe_path):
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<|endoftext|>": 1, "<|mask|>": 2}))
    assert mask_id_from_tokenizer(tmp_path) == 2
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"mask_token": "<mdm_mask>"}))
    (tmp_path / "added_tokens.json").write_text(json.dumps({"<mdm_mask>": 7}))
    assert mask_id_from_tokenizer(tmp_path) == 7
    path = tmp_path / "model"
    shutil.copytree(lladamoe_path, path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("mask_token_id")
    (path / "config.json").write_text(json.dumps(raw))
    (path / "tokenizer.json").unlink()
    (path / "added_tokens.json").write_text(json.dumps({"<|mask|>": 2}))
    assert read_model_config(path).mask_token_id == 2


@pytest.mark.parametrize("which", ["llada2", "lladamoe"])
def test_padded_batch_equals_each_prompt_alone(which, llada2_path, lladamoe_path):
    llm = kstep.load(llada2_path if which == "llada2" else lladamoe_path)
    settings = dict(max_tokens=16, block_length=8, temperature=0.0)
    batch = llm.generate(PROMPTS, **settings)
    for prompt, result in zip(PROMPTS, batch):
        [alone] = llm.generate(prompt, **settings)
        assert result.token_ids == alone.token_ids and result.nfe == alone.nfe


def test_router_choices_are_inspectable(llada2_path):
    llm = kstep.load(llada2_path)
    moe = llm.model.layers[1].mlp
    moe.keep_routing = True
    llm.generate(PROMPTS[0], max_tokens=8, block_length=8)
    routing = moe.last_routing
    assert routing.expert_ids.shape[1] == 2 and torch.allclose(routing.weights.sum(-1), torch.tensor(2.5))
