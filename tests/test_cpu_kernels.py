"""The CPU fast paths of the AR step (kstep/layers/linear.py `pack_fused_weights`): projection
weights packed into oneDNN's blocked layout give the unpacked model's logits and greedy tokens, the
parameters they replace stop holding memory; and `kstep bench llamacpp` without a llama.cpp build
says how to make one."""
import subprocess
import sys

import pytest
import torch

import kstep
from kstep.layers.linear import HAS_ONEDNN, pack_fused_weights
from kstep.random_checkpoint import write_random_checkpoint
from kstep.weights import load_model


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """Projections large enough to be packed (q/k/v 1536 x 512, gate/up 2048 x 512, down 512 x 1024)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", family="llama", seed=1, d_model=512,
                                   n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=1024)


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN inner product")
def test_packed_weights_give_the_unpacked_models_outputs(wide_path):
    plain, packed = load_model(wide_path), load_model(wide_path)
    assert pack_fused_weights(packed) == 6  # q/k/v, gate/up and down of each layer (o is smaller)
    assert packed.layers[0].attn.fused[0].is_mkldnn and packed.layers[0].attn.q_proj.weight.is_meta
    ids, positions = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5)[None]
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids, positions), plain(ids, positions), rtol=1e-4, atol=1e-4)
    llm = kstep.load(wide_path)  # packs on load
    assert llm.runner.model.layers[1].mlp.fused[0].is_mkldnn
    got = llm.generate([[5, 6, 7]], max_tokens=12, ignore_eos=True)[0].token_ids
    want = []
    with torch.inference_mode():  # greedy with the unpacked model, recomputing the whole prefix
        tokens = [5, 6, 7]
        for _ in range(12):
            logits = plain(torch.tensor([tokens]), torch.arange(len(tokens))[None])
            tokens.append(int(logits[0, -1].argmax()))
            want.append(tokens[-1])
    assert got == want


def test_bench_llamacpp_without_a_build_says_how_to_make_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kstep", "bench", "llamacpp", "--llamacpp", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "scripts/build_llamacpp.sh" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "kstep", "bench", "llamacpp", "--weights", "fp8"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--weights 'fp8'" in done.stderr, done.stderr
