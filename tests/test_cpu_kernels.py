"""The CPU fast paths of the AR step: kstep's own GEMV kernels (kstep/layers/cpu_kernels.py) give
torch's results for float32, bf16 and int8 weights at every row count and ragged shape they take,
and so does its RMSNorm (with the residual add before it); a model running on them gives the torch
model's greedy tokens; many rows of bf16 or int8 weights widen a slice at a time; where they are not built,
projection weights packed into oneDNN's blocked layout (kstep/layers/linear.py `pack_fused_weights`)
do the same and the parameters they replace stop holding memory; an int8 model's tied head is
quantized too; and `kstep bench llamacpp` without a llama.cpp build says how to make one."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kstep
from kstep.layers import cpu_kernels
from kstep.layers import linear as linear_module
from kstep.layers.linear import HAS_ONEDNN, linear, pack_fused_weights
from kstep.layers.norm import RMSNorm, add_rms_norm
from kstep.layers.quantized import Int4Linear, Int8Linear, quantize_model
from kstep.random_checkpoint import write_random_checkpoint
from kstep.weights import load_model


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory):
    """Projections large enough to be packed (q/k/v 1536 x 512, gate/up 2048 x 512, down 512 x 1024)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("wide") / "ckpt", family="llama", seed=1, d_model=512,
                                   n_layers=2, n_heads=8, n_kv_heads=8, ffn_dim=1024)


needs_gemv = pytest.mark.skipif(not cpu_kernels.available(),
                                reason="kstep's CPU kernels are off here (no AVX2/FMA, no C compiler, "
                                "a failed build or KSTEP_CPU_KERNELS=0)")


def greedy_by_recomputing(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from the whole prefix each step (no KV cache, every projection over many rows:
    torch's kernels, never the GEMV's)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None])
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_f,in_f", [(1024, 512), (1031, 509), (517, 1003)])  # ragged: tails of 8/16 lanes
def test_gemv_matches_torch(dtype, rows, out_f, in_f):
    gen = torch.Generator().manual_seed(rows + out_f)
    weight = torch.randn(out_f, in_f, generator=gen).to(dtype)
    bias = torch.randn(out_f, generator=gen).to(dtype)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    with torch.inference_mode():
        assert cpu_kernels.takes(x, weight)
        got = cpu_kernels.gemv(x, weight, bias)
        routed = linear(x[:, None], weight, bias)[:, 0]  # linear() sends the decode rows here
        exact = (x.double() @ weight.double().t() + bias.double())
    assert got.dtype == dtype and got.shape == (rows, out_f)
    if dtype == torch.float32:
        torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-4)
    else:  # float32 sums rounded once to bf16: within one bf16 rounding of the exact result
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    assert torch.equal(routed, got)


# int4: an odd number of groups of 32, a last block of 256 with fewer than 8 of them
QUANTIZED = [("int8", 1024, 768), ("int8", 515, 1041), ("int4", 1024, 768), ("int4", 515, 1056), ("int4", 7, 32)]


def takes_quantized(x: torch.Tensor, q: torch.nn.Module) -> bool:
    if isinstance(q, Int8Linear):
        return cpu_kernels.takes_int8(x, q.weight_int8)
    return cpu_kernels.takes_int4(x, q.packed, q.scale, q.low, q.group_size)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind,out_f,in_f", QUANTIZED)
def test_quantized_gemvs_match_the_dequantized_weight(kind, rows, out_f, in_f):
    gen = torch.Generator().manual_seed(out_f)
    layer = torch.nn.Linear(in_f, out_f)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=gen))
    q = Int8Linear(layer) if kind == "int8" else Int4Linear(layer, group_size=32)
    x = torch.randn(rows, in_f, generator=gen) * torch.linspace(0.01, 3, in_f)  # uneven magnitudes per block
    with torch.inference_mode():
        assert takes_quantized(x, q) and not takes_quantized(torch.randn(5, in_f), q)  # 5 rows: torch's
        got = q(x)
        weight = q.dequantized(torch.float64)
        exact = x.double() @ weight.t() + layer.bias.double()
    # x is rounded to int16 per block of 256 (scale: the block's largest |x| / 32767), so each sum is
    # off by at most half a step per element, times |w|; plus float32 sums
    steps = torch.cat([blk.abs().amax(-1, keepdim=True).expand_as(blk) / 32767
                       for blk in x.double().split(256, -1)], -1)
    bound = (steps / 2) @ weight.abs().t() + 1e-5 * (x.double().abs() @ weight.abs().t())
    assert ((got.double() - exact).abs() <= bound).all()
    assert (bound < 1e-3 * (x.double().abs() @ weight.abs().t())).all()  # and that is small


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dim", [512, 899])
def test_rms_norm_and_its_residual_add_match_torch(dtype, rows, dim):
    gen = torch.Generator().manual_seed(dim)
    x, delta = (torch.randn(rows, dim, generator=gen) * 3).to(dtype), torch.randn(rows, dim, generator=gen).to(dtype)
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    norm.to(dtype)

    def torch_norm(v):  # RMSNorm's own torch path
        return norm.weight * F.rms_norm(v.float(), (dim,), eps=1e-6).to(dtype)
    with torch.inference_mode():
        assert cpu_kernels.takes_norm(x, norm.weight) and not cpu_kernels.takes_norm(x[:, :256], norm.weight[:256])
        total, y = add_rms_norm(x, delta, norm)
        assert torch.equal(total, x + delta)
        torch.testing.assert_close(y, torch_norm(x + delta), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
        torch.testing.assert_close(norm(x), torch_norm(x), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)


@needs_gemv
def test_int8_quantization_at_load_gives_the_torch_expressions_codes():
    w = torch.randn(700, 300, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3] = 0  # an all-zero row: the scale's floor
    w[5, :10] = torch.tensor([0.5, -0.5, 1.5, 2.5, -2.5, 127.5, -300.0, 1e-13, 0.0, 3.0])  # ties, clamps
    codes, scales = cpu_kernels.quantize_int8(w)
    want_scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    assert torch.equal(scales, want_scales)
    assert torch.equal(codes, (w / want_scales[:, None]).round().clamp(-127, 127).to(torch.int8))


def test_many_rows_of_bf16_and_int8_weights_widen_a_slice_at_a_time(monkeypatch):
    """A prefill's rows (more than the GEMV takes) of a bf16 weight on a CPU without bf16 matmuls, and
    of int8 codes: the weight widened to float32 in slices into a reused buffer (here 3 of them)."""
    monkeypatch.setattr(linear_module, "WIDEN_ELEMENTS", 500 * 700)
    gen = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(*shape, generator=gen) for shape in ((40, 700), (1300, 700), (1300,)))
    with torch.inference_mode():
        got = linear_module._widened(x.bfloat16(), w.bfloat16(), bias.bfloat16())
        exact = x.bfloat16().double() @ w.bfloat16().double().t() + bias.bfloat16().double()
        assert got.dtype == torch.bfloat16 and got.shape == (40, 1300)
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    layer = torch.nn.Linear(700, 1300)
    with torch.no_grad():
        layer.weight.copy_(w)
    q = Int8Linear(layer)
    with torch.inference_mode():
        torch.testing.assert_close(q(x), x @ q.dequantized(torch.float32).t() + layer.bias, rtol=1e-5, atol=1e-4)


@needs_gemv
def test_a_model_on_the_gemv_gives_torchs_greedy_tokens(wide_path):
    llm = kstep.load(wide_path)
    mlp, attn = llm.runner.model.layers[1].mlp, llm.runner.model.layers[1].attn
    fused = mlp.fused[0]
    assert not fused.is_mkldnn and fused.is_contiguous()  # the plain (out, in) layout the GEMV reads
    # read from the checkpoint straight into the fused layout: fusing copied nothing
    assert fused.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert mlp.up_proj.weight.data_ptr() == fused[mlp.gate_proj.out_features:].data_ptr()
    assert attn.fused[0].data_ptr() == attn.q_proj.weight.data_ptr()
    assert attn.fused_out[0].data_ptr() == attn.o_proj.weight.data_ptr()
    got = llm.generate([[5, 6, 7]], max_tokens=12, ignore_eos=True)[0].token_ids
    assert got == greedy_by_recomputing(load_model(wide_path), [5, 6, 7], 12)


@needs_gemv
def test_int8_quantizes_a_tied_head(tmp_path):
    path = write_random_checkpoint(tmp_path / "tied", family="llama", seed=3, d_model=512, n_layers=1, n_heads=8,
                                   n_kv_heads=8, ffn_dim=1024, vocab_size=1200, tie=True)
    model = load_model(path)
    assert model.lm_head is None
    counts = quantize_model(model, "int8")
    assert isinstance(model.lm_head, Int8Linear) and counts["int8"] == 8  # q, k, v, o, gate, up, down, head
    hidden = torch.randn(1, 1, 512)
    with torch.inference_mode():
        got = model.logits(hidden)
        want = hidden @ model.lm_head.dequantized(torch.float32)[: model.cfg.vocab_size].t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN inner product")
def test_packed_weights_give_the_unpacked_models_outputs(wide_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)  # where kstep's GEMV is not built, oneDNN's packing
    plain, packed = load_model(wide_path), load_model(wide_path)
    assert pack_fused_weights(packed) == 6  # q/k/v, gate/up and down of each layer (o is smaller)
    assert packed.layers[0].attn.fused[0].is_mkldnn and packed.layers[0].attn.q_proj.weight.is_meta
    ids, positions = torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5)[None]
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids, positions), plain(ids, positions), rtol=1e-4, atol=1e-4)
    llm = kstep.load(wide_path)  # packs on load
    assert llm.runner.model.layers[1].mlp.fused[0].is_mkldnn
    got = llm.generate([[5, 6, 7]], max_tokens=12, ignore_eos=True)[0].token_ids
    assert got == greedy_by_recomputing(plain, [5, 6, 7], 12)


def test_bench_llamacpp_without_a_build_says_how_to_make_one(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kstep", "bench", "llamacpp", "--llamacpp", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "scripts/build_llamacpp.sh" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "kstep", "bench", "llamacpp", "--weights", "fp8"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--weights 'fp8'" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "kstep", "bench", "llamacpp", "--weights", "int4"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "int4 runs on GGUF files only" in done.stderr, done.stderr
