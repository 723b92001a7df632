"""The decode step's block in one C call (kstep/layers/cpu_decode.py): on one token against a KV
cache it gives the torch block's hidden states and writes the same keys and values, for float32 and
int8 weights, fused or not, with q/k/v bias, grouped-query attention, Qwen3's q/k norm and partial
rotary (the torch block fed the C block's tokens: no greedy near-tie decides what is compared); a
model on it gives the torch path's logits within a stated tolerance and, where every step's top-2
margin exceeds twice that (asserted), its greedy tokens; it follows weights moved in place
(`.to()`); and every pass it does not compute (several rows, a mask, gradients, small weights,
another dtype, a slot past the cache) goes to the torch path."""
import dataclasses

import pytest
import torch

import kstep
from kstep.layers import cpu_decode, cpu_kernels
from kstep.layers.attention import Segment
from kstep.layers.paged_kv import PagedKV
from kstep.layers.quantized import quantize_model
from kstep.models.transformer import Transformer
from kstep.random_checkpoint import random_config, write_random_checkpoint

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="kstep's CPU kernels are off here (no AVX2/FMA, no C compiler, "
                                "a failed build or KSTEP_CPU_KERNELS=0)")

SLOTS = 24  # cache slots: more than the tokens written, so the C call must stop at the token's own slot


def random_model(seed=0, n_kv_heads=2, qkv_bias=True, qk_norm=False, rotary_dim=None, fused=True,
                 int8=False, d_model=768, n_heads=12, int4=False):
    """A 2-layer model with projections large enough for kstep's GEMVs (cpu_kernels.MIN_WEIGHT)."""
    cfg = random_config("qwen2", 600, d_model=d_model, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                        ffn_dim=1024, head_dim=64)
    cfg = dataclasses.replace(cfg, qkv_bias=qkv_bias, qk_norm=qk_norm, rotary_dim=rotary_dim)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.dim() == 2 else p.uniform_(0.8, 1.2)
    if fused:
        model.fuse_projections()
    if int8 or int4:
        quantize_model(model, "int8" if int8 else "int4")
    return model


def empty_cache(model, batch=1):
    return model.allocate_kv(batch, SLOTS)


def scattered_cache(model):
    """One row of SLOTS slots on pages of 4 out of order: read through its table, not a view."""
    kv = PagedKV(model.allocate_kv(1, SLOTS).storage, 4, [[5, 0, 3, 1, 4, 2]], SLOTS)
    assert not kv.is_view
    return kv


def layers_run_in_c(monkeypatch) -> list[int]:
    """A list that grows by each C call's number of layers (one call per pass over the whole stack, or
    one per layer where a layer takes torch's path)."""
    calls = []
    real = cpu_decode.forward_stack
    monkeypatch.setattr(cpu_decode, "forward_stack", lambda stack, *a: calls.append(stack.n) or real(stack, *a))
    return calls


def decode(model, prompt, steps, monkeypatch, in_c, tokens=None, cache=empty_cache):
    """Hidden states of `steps` one-token passes after a prompt pass (several rows: torch's path
    either way), each token the previous pass's greedy pick, or `tokens` where given (the other path's
    picks: two paths a last bit apart may break a near-tie apart); the cache they leave; the tokens."""
    with monkeypatch.context() as m:
        if not in_c:
            m.setattr(cpu_decode, "ENABLED", False)
        caches, states, picked = cache(model), [], []
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            hidden = model.hidden_states(ids, torch.arange(len(prompt))[None], None, caches, 0)
            for i, t in enumerate(range(len(prompt), len(prompt) + steps)):
                token = model.logits(hidden[:, -1:]).argmax(-1) if tokens is None else torch.tensor([[tokens[i]]])
                picked.append(int(token))
                hidden = model.hidden_states(token, torch.tensor([[t]]), None, caches, t)
                states.append(hidden[0, 0])
    return torch.stack(states), caches, picked


VARIANTS = {
    "gqa+bias": {},
    "q/k norm": {"qk_norm": True, "qkv_bias": False},
    "partial rotary": {"rotary_dim": 32},
    "unfused, one head per kv head": {"fused": False, "n_kv_heads": 12},
    "int8": {"int8": True},
    "int8 q/k norm": {"int8": True, "qk_norm": True},
    "int4": {"int4": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_c_block_gives_the_torch_blocks_states_and_cache(variant, monkeypatch):
    model = random_model(**VARIANTS[variant])
    calls = layers_run_in_c(monkeypatch)
    got, got_cache, tokens = decode(model, [5, 6, 7, 8, 9], 6, monkeypatch, in_c=True)
    assert calls == [model.cfg.n_layers] * 6  # every decode pass ran every layer in one C call
    want, want_cache, _ = decode(model, [5, 6, 7, 8, 9], 6, monkeypatch, in_c=False, tokens=tokens)
    # int8: the GEMV rounds its input to int16 per block, so the attention's last-bit differences
    # (the order of its sums) can move a code by one: ~1e-4 here, against int8's own error of ~0.07
    tol = 1e-3 if VARIANTS[variant].get("int8") or VARIANTS[variant].get("int4") else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for (gk, gv), (wk, wv) in ((c.read(i, 0, SLOTS) for c in (got_cache, want_cache))
                               for i in range(model.cfg.n_layers)):
        torch.testing.assert_close(gk, wk, rtol=tol, atol=tol)
        torch.testing.assert_close(gv, wv, rtol=tol, atol=tol)
        assert not gk[:, :, 11:].any()  # nothing written past the last token's slot


def test_the_c_block_walks_a_scattered_caches_table_as_it_reads_a_view(monkeypatch):
    """Pages out of order: the C block reads them through the row's slot index, with the bits of a
    cache on one run of pages (the same sums in the same order), and as torch's gathered path does."""
    model = random_model()
    calls = layers_run_in_c(monkeypatch)
    view, view_cache, tokens = decode(model, [5, 6, 7, 8, 9], 6, monkeypatch, in_c=True)
    got, got_cache, _ = decode(model, [5, 6, 7, 8, 9], 6, monkeypatch, in_c=True, tokens=tokens, cache=scattered_cache)
    assert calls == [model.cfg.n_layers] * 12  # both ran in C
    torch.testing.assert_close(got, view, rtol=0, atol=0)
    want, want_cache, _ = decode(model, [5, 6, 7, 8, 9], 6, monkeypatch, in_c=False, tokens=tokens, cache=scattered_cache)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for i in range(model.cfg.n_layers):
        assert torch.equal(got_cache.read(i, 0, SLOTS)[0], view_cache.read(i, 0, SLOTS)[0])



def test_a_layer_on_torchs_path_leaves_the_others_in_c_one_call_each(monkeypatch):
    """A sparse MoE layer takes torch's path: the stack is not one C call, the dense layer before it
    still runs in C, alone, with the torch path's states."""
    cfg = random_config("llada2_moe", 600, d_model=768, n_layers=2, n_heads=12, head_dim=64, num_experts=8,
                        expert_dim=64, dense_layers=1, ffn_dim=1024)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05) if p.dim() == 2 else p.uniform_(0.8, 1.2)
    model.fuse_projections()
    calls = layers_run_in_c(monkeypatch)
    got, _, tokens = decode(model, [5, 6, 7], 4, monkeypatch, in_c=True)
    assert calls == [1] * 4  # layer 0 in C on each pass, layer 1 in torch
    want, _, _ = decode(model, [5, 6, 7], 4, monkeypatch, in_c=False, tokens=tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_stacks_c_call_is_kept_until_the_cache_pages_change():
    model = random_model()
    kv = scattered_cache(model)
    x, segments = torch.randn(1, 768), [Segment(0, 1, 1, cache=kv, cache_start=3)]
    with torch.inference_mode():
        first = cpu_decode.plan_stack(model.layers, x, segments, None)
        assert first is not None and cpu_decode.plan_stack(model.layers, x, segments, None) is first
        kv.tables = [[0, 5, 3, 1, 4, 2]]
        kv.reindex()  # new pages: a new slot index for the C to walk
        again = cpu_decode.plan_stack(model.layers, x, segments, None)
        assert again is not first and again.slots == kv.slots.data_ptr()

# How far the two paths' logits may differ. float32: the order of the sums in the attention and the
# exp in SiLU and softmax, ~2e-5 measured. int8: the GEMV rounds its input to int16 per block (both
# paths run that same GEMV), so those last-bit differences move a code by one here and there: up to
# 2.3e-3 measured (5 models x 3 prompts, torch dispatching its AVX2 and its AVX-512 kernels, 1 and 2
# threads), against logits of +-14. Each bound is 4-10x the largest measured.
LOGIT_TOLERANCE = {None: 2e-4, "int8": 1e-2}


def generate_recording_logits(llm, prompt, max_tokens):
    """The greedy tokens and, per token, the logits it was picked from."""
    model, logits = llm.runner.model, []
    real_logits = model.logits

    def recording(hidden):
        out = real_logits(hidden)
        logits.append(out.reshape(-1, out.shape[-1])[-1].float().clone())  # the last position's: the pick's
        return out
    model.logits = recording
    try:
        tokens = llm.generate([prompt], max_tokens=max_tokens, ignore_eos=True)[0].token_ids
    finally:
        del model.logits
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_model_on_the_c_block_gives_the_torch_paths_greedy_tokens(quantize, tmp_path, monkeypatch):
    """Equal greedy tokens are a claim only where no step is a near-tie: each step's logits are within
    LOGIT_TOLERANCE of the torch path's (on the same prefix), and each step's top-2 margin exceeds
    twice that, so the torch path's pick is the C path's at every step (by induction on the prefix)."""
    path = write_random_checkpoint(tmp_path / "qwen2", family="qwen2", seed=2, d_model=768, n_layers=2, n_heads=12,
                                   n_kv_heads=2, ffn_dim=1024)
    llm = kstep.load(path, quantize=quantize)
    prompt, tol = [1, 2, 3], LOGIT_TOLERANCE[quantize]
    calls = layers_run_in_c(monkeypatch)
    got, got_logits = generate_recording_logits(llm, prompt, 16)
    assert calls == [2] * 15  # the 15 one-token passes after the prompt's, both layers in C
    assert got_logits.shape[0] == len(got)  # one pick per pass
    top2 = got_logits.topk(2, -1).values
    margins = top2[:, 0] - top2[:, 1]
    # the C path's numerics do not depend on the CPU (built for AVX2 everywhere): this model and prompt
    # were picked for a smallest margin of 0.16 (float32) and 0.195 (int8), 10x what this needs
    assert (margins > 2 * tol).all(), f"a near-tie: this model and prompt prove nothing, margins {margins}"
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    want, want_logits = generate_recording_logits(llm, prompt, 16)
    assert calls == [2] * 15  # this time none ran in C
    same_prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got)) + 1
    diff = (got_logits[:same_prefix] - want_logits[:same_prefix]).abs().amax(-1)
    assert (diff <= tol).all(), f"logits apart by {diff} (tolerance {tol})"
    assert got == want


def test_passes_it_does_not_compute_go_to_torch():
    model, small = random_model(), random_model(d_model=128, n_heads=2)  # small: weights under MIN_WEIGHT
    moe = Transformer(random_config("llada2_moe", 600, d_model=768, n_layers=1, n_heads=12, head_dim=64,
                                    num_experts=8, expert_dim=64, dense_layers=0)).eval()
    moe.fuse_projections()
    block, caches = model.layers[0], empty_cache(model)
    one = torch.randn(1, 768)

    def plan(x=one, block=block, caches=caches, **seg):
        return cpu_decode.plan(block, x, [Segment(**{"offset": 0, "batch": 1, "length": 1, "cache": caches,
                                                      "cache_start": 3, **seg})], 0, None)

    with torch.inference_mode():
        assert plan() is not None
        assert plan(x=torch.randn(2, 768), length=2) is None  # two tokens
        assert plan(x=torch.randn(2, 768), batch=2) is None  # two sequences
        assert plan(mask=torch.ones(1, 1, 1, 4, dtype=torch.bool)) is None
        assert plan(cache=None) is None
        assert plan(cache_len=10) is None  # a DualCache suffix
        assert plan(cache_start=SLOTS) is None  # past the cache's end: torch's path raises
        assert plan(caches=empty_cache(model, batch=2)) is None  # a cache of two rows
        assert plan(caches=scattered_cache(model)) is not None  # read through its table
        shared = scattered_cache(model)
        shared.shared_until = 2
        assert plan(caches=shared) is not None and plan(caches=shared, cache_start=1) is None  # a shared page
        assert plan(x=one.bfloat16()) is None
        assert plan(block=small.layers[0], x=torch.randn(1, 128), caches=empty_cache(small)) is None
        assert plan(block=moe.layers[0], caches=empty_cache(moe)) is None  # a sparse MoE feed-forward
        assert cpu_decode.plan(block, one, [Segment(0, 1, 1, cache=caches)], 0, torch.ones(1)) is None  # q_scale
    with torch.no_grad(), torch.enable_grad():
        assert plan() is None  # training: autograd needs torch's ops


def test_weights_moved_in_place_are_read_from_their_new_memory(monkeypatch):
    """`.to()` keeps each Parameter and swaps its tensor: the C block must follow, never read the old memory."""
    model = random_model(fused=False, n_kv_heads=12)
    before, _, _ = decode(model, [5, 6, 7], 2, monkeypatch, in_c=True)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data * 1.5 if p.dim() == 2 else p.data.clone()  # new memory, new values
    got, _, tokens = decode(model, [5, 6, 7], 2, monkeypatch, in_c=True)
    want, _, _ = decode(model, [5, 6, 7], 2, monkeypatch, in_c=False, tokens=tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, before, atol=1e-3)
