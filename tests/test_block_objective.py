"""The block-diffusion training objective sees what decoding sees: each masked token's training
logits equal the logits the decoder computes for it (block-causal prefill of the clean blocks before
it, a block pass over its noisy block, the shift: the first token of a block from the previous clean
block's last position); the loss trains and the trained model reloads and decodes."""
import torch

from kstep.models import Transformer
from kstep.runner.model_runner import ModelRunner
from kstep.train.block_objective import block_diffusion_loss, block_training_mask, shifted_sources
from kstep.train.trainer import TrainConfig, init_weights, model_config


def test_training_logits_equal_decoding_logits():
    cfg = TrainConfig(objective="block-diffusion", out="unused", d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                      ffn_dim=64, seq_len=16, block_size=4)
    V, mask = 50, 49
    model = Transformer(model_config(cfg, V, {"mask": mask, "pad": 0, "eos": 1}))
    init_weights(model, 0)
    model.eval()
    L, bs = 16, 4
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 48, (1, L), generator=g)
    is_masked = torch.rand(1, L, generator=g) < 0.5
    is_masked[0, 0] = False
    noisy = torch.where(is_masked, mask, tokens)
    runner = ModelRunner(model)
    with torch.no_grad():
        hidden = model.hidden_states(torch.cat([noisy, tokens], 1), torch.arange(L).repeat(2)[None],
                                     block_training_mask(L, bs)[None, None])
        train_logits = model.logits(hidden[0, shifted_sources(L, bs)])  # (L, V)
        checked = 0
        for start in range(0, L, bs):
            kv = runner.allocate_kv(1, L + bs)
            if start:
                last = runner.logits(runner.block_prefill_pass(tokens[:, :start], None, bs, kv))[0, -1]
            block = runner.logits(runner.ragged_causal_pass(
                noisy[:, start:start + bs], torch.arange(start, start + bs)[None], torch.tensor([start]),
                torch.ones(1, L + bs, dtype=torch.bool), kv, is_causal=False, kind="block"))[0]
            for j in range(start, start + bs):
                if is_masked[0, j]:
                    decoded = last if j == start else block[j - start - 1]
                    torch.testing.assert_close(decoded, train_logits[j], atol=1e-5, rtol=1e-5)
                    checked += 1
    assert checked >= 4 and any(is_masked[0, s] for s in range(bs, L, bs))  # block starts among them


def test_loss_is_finite_with_nothing_masked():
    cfg = TrainConfig(objective="block-diffusion", out="unused", d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                      ffn_dim=64, seq_len=8, block_size=4)
    model = Transformer(model_config(cfg, 50, {"mask": 49, "pad": 0, "eos": 1}))
    tokens = torch.randint(2, 48, (2, 8))
    loss = block_diffusion_loss(model, tokens, 49, 4, complementary=False, ratio_range=(0.0, 0.0))
    loss.backward()  # a step that changes nothing, rather than a NaN that would poison the weights
    assert loss.detach().item() == 0.0
