"""kstep's llama/qwen2 models against Hugging Face transformers on tiny random checkpoints."""
import pytest
import torch

import kstep
from kstep.runner.model_runner import positions_from_padding

transformers = pytest.importorskip("transformers")

VOCAB = 97


def make_hf(kind: str, path, tie: bool = False, shard: bool = False):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        config = transformers.LlamaConfig(rope_theta=5000.0, rms_norm_eps=1e-5, **common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(rope_theta=10000.0, **common)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF inits norms to exactly one and biases to zero: perturb so mistakes show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(path, max_shard_size="20KB" if shard else "2GB")
    return model


@pytest.mark.parametrize("kind,tie,shard", [("llama", False, False), ("qwen2", False, True), ("llama", True, False)])
def test_logits_and_greedy_match_transformers(tmp_path, kind, tie, shard):
    hf = make_hf(kind, tmp_path, tie=tie, shard=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    llm = kstep.load(tmp_path)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = hf(ids).logits
        positions = torch.arange(11).expand(2, -1)
        got = llm.model(ids, positions)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    prompt = ids[0].tolist()
    with torch.no_grad():
        hf_out = hf.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, 11:].tolist()
    ours = llm.generate(prompt, max_tokens=24)[0]
    # kstep cuts at the checkpoint's EOS (id 2); compare up to that point.
    cut = hf_out.index(2) if 2 in hf_out else len(hf_out)
    assert ours.token_ids == hf_out[:cut]
    assert ours.finish_reason == ("stop" if cut < len(hf_out) else "length")


def test_padded_batch_logits_match_transformers(tmp_path):
    hf = make_hf("llama", tmp_path)
    llm = kstep.load(tmp_path)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1 is left-padded by 4
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask).logits[:, -1]
    key_mask = mask.bool()
    kv = llm.runner.allocate_kv(2, 9)
    got = llm.runner.logits(llm.runner.causal_pass(ids, positions_from_padding(key_mask), key_mask, 0, kv))[:, -1]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
