"""`kstep train`: the objectives learn, checkpoints reload exactly, and resuming continues the same run."""
import shutil

import pytest
import torch

import kstep
from kstep.train.corpus import stdlib_root
from kstep.train.objectives import forward_process
from kstep.train.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "bisect.py", "heapq.py", "shlex.py", "string.py", "fnmatch.py", "glob.py"):
        shutil.copy(stdlib_root() / name, root / name)
    return root


def tiny(corpus, out, objective, **overrides) -> TrainConfig:
    settings = dict(objective=objective, out=str(out), corpus=str(corpus), vocab_size=400, d_model=64, n_layers=2,
                    n_heads=2, n_kv_heads=2, ffn_dim=128, seq_len=64, batch_size=8, lr=3e-3, warmup_steps=5,
                    token_budget=8 * 64 * 40, eval_every=1000, eval_windows=4, save_every=1000)
    return TrainConfig(**{**settings, **overrides})


def fixed_loss(trainer: Trainer) -> float:
    tokens = trainer.eval_batch
    with torch.no_grad():
        return float(trainer.loss(tokens, torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("objective", ["diffusion", "ar", "block-diffusion"])
def test_training_lowers_loss_and_reloads_exactly(tmp_path, corpus, objective):
    trainer = Trainer(tiny(corpus, tmp_path / objective, objective))
    before = fixed_loss(trainer)
    out = trainer.train()
    after = fixed_loss(trainer)
    assert after < 0.85 * before, (before, after)
    # The exported checkpoint (bf16, family layout) reloads through kstep.load with identical logits.
    llm = kstep.load(out)
    assert llm.cfg.family == {"diffusion": "llada", "ar": "llama", "block-diffusion": "fast_dllm_v2"}[objective]
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        ids = trainer.eval_batch[:2]
        positions = torch.arange(ids.shape[1]).expand(2, -1)
        torch.testing.assert_close(llm.model(ids, positions), trainer.model(ids, positions), atol=1e-5, rtol=0)
    knobs = {"diffusion": {"steps": 8}, "block-diffusion": {"steps": 4}}.get(objective, {})
    assert llm.tokenizer is not None and llm.generate("def f(x):", max_tokens=8, **knobs)[0].nfe >= 1


def test_resume_continues_the_same_run(tmp_path, corpus):
    straight = Trainer(tiny(corpus, tmp_path / "a", "diffusion", token_budget=8 * 64 * 6, save_every=3))
    straight.train()
    first = Trainer(tiny(corpus, tmp_path / "b", "diffusion", token_budget=8 * 64 * 6, save_every=3))
    first.cfg.token_budget = 8 * 64 * 3  # stop after 3 steps, as if interrupted
    first.train()
    resumed = Trainer(tiny(corpus, tmp_path / "b", "diffusion", token_budget=8 * 64 * 6, save_every=3))
    resumed.train(resume=True)
    assert resumed.step == 6
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)


def test_prompt_tokens_are_never_masked():
    tokens = torch.arange(40).view(4, 10)
    lengths = torch.tensor([0, 3, 7, 10])
    for seed in range(20):
        noisy, is_masked, p_mask = forward_process(tokens, 99, torch.Generator().manual_seed(seed), lengths)
        for row, n in enumerate(lengths.tolist()):
            assert not is_masked[row, :n].any()
            assert (noisy[row, :n] == tokens[row, :n]).all()
        assert ((noisy == 99) == is_masked).all()
        assert ((p_mask > 0) & (p_mask <= 1)).all()


def test_prompt_completion_objective_trains(tmp_path, corpus):
    trainer = Trainer(tiny(corpus, tmp_path / "pc", "diffusion", prompt_completion=True, token_budget=8 * 64 * 3))
    assert len(trainer.pairs[0]) > 0 and (trainer.pairs[1] > 0).all()
    trainer.train()
    assert trainer.step == 3 and all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.log)
