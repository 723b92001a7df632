"""The MoE families as checkpoints ship them: which family a config.json is, sharded safetensors
with an index, per-expert tensors stacked at load, bf16 kept bf16, mask ids where the tokenizer
files keep them, and packed batches equal to each request alone. LLaDA-MoE on LLaDA's sampler
with the knobs it shares with LLaDA (factor, cfg_scale, seeded `random` remasking), token for token
against tests/llada_reference.py's samplers run on tests/moe_reference.py's LLaDA-MoE (the
threshold and exact settings are in tests/test_llada2.py)."""
import json
import shutil

import pytest
import torch
from llada_reference import fast_dllm_generate, reference_generate
from moe_reference import (
    FIRST_SPECIAL_ID,
    MASK_ID,
    ReferenceLLaDAMoE,
    _attend,
    _linear,
    _partial_rotary,
    _rms_norm,
    _swiglu,
    write_llada_moe_checkpoint,
)

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


class CachedLLaDAMoE(ReferenceLLaDAMoE):
    """`ReferenceLLaDAMoE`'s layers with Fast-dLLM's LLaDA caches, in llada_reference.ReferenceLLaDA.forward's
    contract: `forward(x, past=None, replace_start=None)` -> (logits, per-layer pre-rotary (k, v)); `past` alone:
    keys = past + new, queries after the past (prefix); with `replace_start`: new keys overwrite the past's slots
    from there (dual). Fast-dLLM has no LLaDA-MoE model code: this is its LLaDA cache on LLaDA-MoE's layer."""

    def forward(self, x, attention_mask=None, past=None, replace_start=None):
        c, w = self.c, self.w
        B, L = x.shape
        H, Hkv, hd, eps = self.H, self.Hkv, self.hd, c["rms_norm_eps"]
        q_start = 0 if past is None else past[0][0].shape[2] if replace_start is None else replace_start
        h = w["model.embed_tokens.weight"][x]
        present = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            a = _rms_norm(h, w[p + "input_layernorm.weight"], eps)
            q, k, v = (_linear(w, a, p + f"self_attn.{name}_proj") for name in "qkv")
            if c.get("qk_layernorm"):
                q = _rms_norm(q.reshape(B, L, H, hd), w[p + "self_attn.q_norm.weight"], eps).reshape(B, L, -1)
                k = _rms_norm(k.reshape(B, L, Hkv, hd), w[p + "self_attn.k_norm.weight"], eps).reshape(B, L, -1)
            if c.get("clip_qkv") is not None:
                q, k, v = (t.clamp(-c["clip_qkv"], c["clip_qkv"]) for t in (q, k, v))
            q = q.view(B, L, H, hd).transpose(1, 2)
            k, v = (t.view(B, L, Hkv, hd).transpose(1, 2) for t in (k, v))
            if past is not None and replace_start is None:
                k, v = torch.cat([past[i][0], k], 2), torch.cat([past[i][1], v], 2)
            elif past is not None:
                old_k, old_v = past[i][0].clone(), past[i][1].clone()
                old_k[:, :, replace_start:replace_start + L], old_v[:, :, replace_start:replace_start + L] = k, v
                k, v = old_k, old_v
            present.append((k, v))
            q = _partial_rotary(q, torch.arange(q_start, q_start + L), c["rope_theta"], self.rotary_dim)
            k = _partial_rotary(k, torch.arange(k.shape[2]), c["rope_theta"], self.rotary_dim)
            att = _attend(q, k, v, None).transpose(1, 2).reshape(B, L, H * hd)
            h = h + _linear(w, att, p + "self_attn.o_proj")
            f = _rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
            if c["moe_layer_freq"][i] == 0:
                h = h + _swiglu(w, f, p + "mlp.")
                continue
            y, _ = self._moe(f, p)
            if p + "shared_expert.gate_proj.weight" in w:
                y = y + _swiglu(w, f, p + "shared_expert.")
            h = h + y
        h = _rms_norm(h, w["model.norm.weight"], eps)
        return h @ w["lm_head.weight"].T, present


@pytest.fixture(scope="module")
def released_lladamoe(tmp_path_factory):
    """LLaDA-MoE in its released layout (tests/moe_reference.py's writer): kstep's and the reference's."""
    path = write_llada_moe_checkpoint(tmp_path_factory.mktemp("released_lladamoe"), seed=1, num_key_value_heads=2,
                                      moe_router_enable_expert_bias=True, shared_expert_intermediate_size=48)
    ref = CachedLLaDAMoE(path)
    ids = torch.randint(0, FIRST_SPECIAL_ID, (2, 13), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ref(ids), ReferenceLLaDAMoE(path)(ids))  # the cache changes nothing without a past
    return kstep.load(path), ref


def moe_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, FIRST_SPECIAL_ID, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def until_stop(ids: list[int], llm) -> list[int]:
    return ids[:next((i for i, t in enumerate(ids) if t in llm.stop_ids), len(ids))]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("policy", [dict(), dict(threshold=0.5), dict(factor=1.0), dict(factor=4.0)])
@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_llada_moe_cache_modes_and_factor_match_fast_dllm(released_lladamoe, cache, policy, remasking):
    """Fast-dLLM's fixed schedule, threshold and factor (get_transfer_index_dynamic) on LLaDA-MoE with each
    cache, token for token and pass for pass; seeded `random` = the reference after torch.manual_seed."""
    llm, ref = released_lladamoe
    prompt = moe_prompt(6, 9)
    torch.manual_seed(7)
    expected, expected_nfe = fast_dllm_generate(ref, torch.tensor([prompt]), cache, steps=16, gen_length=32,
                                                block_length=8, mask_id=MASK_ID, remasking=remasking, **policy)
    got = llm.generate(prompt, max_tokens=32, block_length=8, steps=16, cache=cache, remasking=remasking, seed=7,
                       early_stop=False, **policy)[0]
    assert got.token_ids == until_stop(expected[0, 6:].tolist(), llm) and got.nfe == expected_nfe


@pytest.mark.parametrize("gen_length,block_length,steps,cfg_scale,remasking", [
    (16, 8, 16, 1.5, "low_confidence"), (24, 8, 9, 0.5, "low_confidence"), (16, 16, 16, 0.0, "random"),
    (32, 8, 16, 0.0, "random"), (24, 8, 9, 0.0, "random"), (16, 8, 8, 1.5, "random"),
])
def test_llada_moe_cfg_and_seeded_random_match_llada_generate(released_lladamoe, gen_length, block_length, steps,
                                                              cfg_scale, remasking):
    """LLaDA's generate on LLaDA-MoE: cfg_scale (the prompt masked in the unconditional rows) and seeded
    `random` (torch.rand((B, L)) over the whole canvas each step), a batch of two prompts of one length (the
    reference ignores attention masks), token for token at temperature 0."""
    llm, ref = released_lladamoe
    prompts = [moe_prompt(6, 9), moe_prompt(6, 10)]
    torch.manual_seed(3)
    expected = reference_generate(ref, torch.tensor(prompts), steps=steps, gen_length=gen_length,
                                  block_length=block_length, cfg_scale=cfg_scale, remasking=remasking, mask_id=MASK_ID)
    got = llm.generate(prompts, max_tokens=gen_length, block_length=block_length, steps=steps, exact=True,
                       cfg_scale=cfg_scale, remasking=remasking, seed=3, early_stop=False)
    for row, result in enumerate(got):
        assert result.token_ids == until_stop(expected[row, 6:].tolist(), llm) and result.nfe == steps
