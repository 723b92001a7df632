"""The sparse MoE layer (kstep/layers/moe.py) against plain per-token restatements: each router's
choices and weights, and the grouped dispatch against running every token's experts one by one."""
import pytest
import torch
import torch.nn.functional as F

import kstep.layers.moe as moe
from kstep.layers.moe import Experts, Router, RouterSpec, Routing, SparseMoE


def naive_sigmoid_grouped(logits, bias, top_k, n_group, topk_group, scaling):
    """LLaDA2MoeGate.forward, one token at a time."""
    ids, weights = [], []
    for row, b in zip(logits.sigmoid(), bias.expand_as(logits)):
        choice = row + b
        size = len(row) // n_group
        group_scores = [sorted(choice[g * size:(g + 1) * size].tolist())[-2:] for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -sum(group_scores[g]))[:topk_group]
        allowed = [e for e in range(len(row)) if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -choice[e].item())[:top_k]
        w = row[chosen]
        w = w / (w.sum() + 1e-20) if top_k > 1 else w
        ids.append(chosen)
        weights.append((w * scaling).tolist())
    return ids, weights


def test_sigmoid_grouped_router_chooses_by_biased_scores_in_kept_groups():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 8, generator=g)
    bias = torch.randn(8, generator=g) * 0.5  # large enough to change the choice
    spec = RouterSpec("sigmoid_grouped", top_k=3, n_group=4, topk_group=2, scaling=2.5, has_bias=True)
    routing = moe.sigmoid_grouped_topk(logits, spec, bias)
    ids, weights = naive_sigmoid_grouped(logits, bias, 3, 4, 2, 2.5)
    assert [sorted(r) for r in routing.expert_ids.tolist()] == [sorted(r) for r in ids]
    order = routing.expert_ids.argsort(-1)
    got = routing.weights.gather(1, order)
    want = torch.tensor([[w for _, w in sorted(zip(i, ws))] for i, ws in zip(ids, weights)])
    assert torch.allclose(got, want, atol=1e-6)
    unbiased = moe.sigmoid_grouped_topk(logits, spec, None)
    assert not torch.equal(unbiased.expert_ids.sort(-1).values, routing.expert_ids.sort(-1).values)


def test_softmax_router_renormalises_or_keeps_raw_probabilities():
    logits = torch.randn(10, 6)
    raw = moe.softmax_topk(logits, RouterSpec("softmax", 2, renormalize=False), None)
    probs = logits.softmax(-1)
    assert torch.allclose(raw.weights, probs.gather(1, raw.expert_ids))
    assert torch.equal(raw.expert_ids, probs.topk(2).indices)
    norm = moe.softmax_topk(logits, RouterSpec("softmax", 2, renormalize=True), None)
    assert torch.allclose(norm.weights.sum(-1), torch.ones(10))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # LLaDA-MoE: the bias is in the weights too
    biased = moe.softmax_topk(logits, RouterSpec("softmax", 2, renormalize=False), bias)
    assert bool((biased.expert_ids == 5).any(-1).all())
    assert torch.allclose(biased.weights, (probs + bias).gather(1, biased.expert_ids))


def test_router_refuses_impossible_group_settings():
    with pytest.raises(ValueError, match="groups"):
        Router(16, 8, RouterSpec("sigmoid_grouped", top_k=2, n_group=8, topk_group=1))
    with pytest.raises(ValueError, match="fewer than top_k"):
        Router(16, 8, RouterSpec("sigmoid_grouped", top_k=5, n_group=4, topk_group=2))
    with pytest.raises(ValueError, match="router 'relu'"):
        RouterSpec("relu", 2)


def naive_experts(experts: Experts, x, routing: Routing):
    out = torch.zeros(x.shape, dtype=torch.float32)
    I = experts.expert_dim
    for t in range(x.shape[0]):
        for e, w in zip(routing.expert_ids[t].tolist(), routing.weights[t].tolist()):
            gate, up = x[t] @ experts.gate_up[e, :, :I], x[t] @ experts.gate_up[e, :, I:]
            out[t] += w * ((F.silu(gate) * up) @ experts.down[e]).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_dispatch_equals_each_token_through_its_experts(grouped, num_tokens, monkeypatch):
    """Both dispatches (a GPU's grouped matmul runs on the CPU too, forced here) and both layouts."""
    if grouped and not moe.HAS_GROUPED_MM:
        pytest.skip("this torch has no _grouped_mm")
    monkeypatch.setattr(Experts, "_can_group", lambda self, rows: grouped)
    torch.manual_seed(0)
    experts = Experts(8, 16, 12)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.3)
        experts.down.normal_(0, 0.3)
    x = torch.randn(num_tokens, 16)
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(num_tokens)])  # experts 6, 7 may go unused
    ids[ids >= 6] = ids[ids >= 6] % 6
    ids = torch.stack([torch.unique(r, sorted=False)[:2] for r in ids])
    routing = Routing(ids, torch.rand(num_tokens, 2))
    with torch.no_grad():
        assert torch.allclose(experts(x, routing), naive_experts(experts, x, routing), atol=1e-5)
        experts.fuse()  # the inference layout (small float32 weights: (in, out)): the same values
        assert torch.allclose(experts(x, routing), naive_experts(experts, x, routing), atol=1e-5)


def test_sparse_moe_adds_the_shared_expert_and_keeps_its_choices_when_asked():
    torch.manual_seed(0)
    block = SparseMoE(16, 8, 12, RouterSpec("softmax", 2), shared_dim=24)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        out = block(x)
        assert block.last_routing is None
        block.keep_routing = True
        block(x)
        routing = block.last_routing
        want = naive_experts(block.experts, x.view(-1, 16), routing) + block.shared(x.view(-1, 16))
    assert out.shape == x.shape and torch.allclose(out.view(-1, 16), want, atol=1e-5)
    assert routing.expert_ids.shape == (6, 2)


@pytest.mark.parametrize("expert_dim", [6, 8])  # 6: rows of 12 bytes, which torch's grouped matmul refuses
def test_bfloat16_experts_stay_bfloat16_on_either_path(expert_dim, monkeypatch):
    torch.manual_seed(0)
    experts = Experts(4, 16, expert_dim)
    with torch.no_grad():
        experts.gate_up.normal_(0, 0.3)
        experts.down.normal_(0, 0.3)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    routing = Routing(torch.tensor([[0, 1], [1, 3]] * 2 + [[3, 0]]), torch.full((5, 2), 0.5))
    grouped = moe.HAS_GROUPED_MM and expert_dim % 8 == 0  # bf16 rows of whole 16-byte units
    with torch.no_grad():
        monkeypatch.setattr(Experts, "_can_group", lambda self, rows: grouped)
        out = experts(x, routing)
        monkeypatch.setattr(Experts, "_can_group", lambda self, rows: False)
        looped = experts(x, routing)
        experts.fuse()  # (out, in) storage, the same parameters' values
        assert not experts.gate_up.is_contiguous() and torch.equal(experts(x, routing), looped)
        monkeypatch.setattr(Experts, "_can_group", lambda self, rows: grouped)
        assert torch.allclose(experts(x, routing).float(), out.float(), atol=2e-2)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), looped.float(), atol=2e-2)
    assert torch.allclose(out.float(), naive_experts(experts, x, routing).float(), atol=5e-2)
