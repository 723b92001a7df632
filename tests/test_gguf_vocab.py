"""GGUF tokenizers against llama.cpp's own: a SentencePiece vocabulary ("llama": Llama 2, Mistral) encodes
as llama.cpp's tokenizer does (its algorithm, written out here: the best-scored adjacent pair merged first,
what is left as its bytes), on a small vocabulary in CI; and, where scripts/build_llamacpp.sh has unpacked
llama.cpp's tree, every vocabulary kstep reads from its test files (models/ggml-vocab-*.gguf with their
.inp texts and the .out ids llama.cpp's test-tokenizer-0 expects)."""
import heapq
import json
import random
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer

import kstep
from kstep.structured import StructuredSpec

from gguf_files import add_spm_vocab, write_gguf
from kstep.gguf.reader import GGUFFile
from kstep.gguf.vocab import tokenizer_files

FIXTURES = Path(__file__).parents[1] / ".kstep-cache" / "llamacpp" / "src" / "models"
SPACE = "\u2581"


def llama_cpp_spm(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm: " " as "\u2581", one before the text; characters merged pairwise,
    the pair whose merge is the best-scored token first (the leftmost among equals); a symbol left
    that is no token becomes its UTF-8 bytes' <0xXX> tokens."""
    if not text:
        return []
    symbols = list(SPACE + text.replace(" ", SPACE))
    alive = [True] * len(symbols)
    right = list(range(1, len(symbols))) + [-1]
    left = [-1] + list(range(len(symbols) - 1))
    queue = []

    def push(i):
        j = right[i]
        if i >= 0 and j >= 0 and (merged := symbols[i] + symbols[j]) in vocab:
            heapq.heappush(queue, (-scores[vocab[merged]], i, merged))
    for i in range(len(symbols) - 1):
        push(i)
    while queue:
        _, i, merged = heapq.heappop(queue)
        j = right[i] if alive[i] else -1
        if j < 0 or symbols[i] + symbols[j] != merged:
            continue  # a stale pair: one side merged since
        symbols[i], alive[j] = merged, False
        right[i] = right[j]
        if right[j] >= 0:
            left[right[j]] = i
        push(left[i])
        push(i)
    out = []
    for symbol, live in zip(symbols, alive):
        if live:
            out += [vocab[symbol]] if symbol in vocab else [vocab[f"<0x{b:02X}>"] for b in symbol.encode()]
    return out


def write_spm_vocab(path: Path, pieces: dict[str, float]) -> Path:
    """A vocabulary-only GGUF of those pieces (gguf_files.add_spm_vocab)."""
    writer = gguf.GGUFWriter(path, "llama")
    add_spm_vocab(writer, pieces)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def random_pieces(count: int, letters: str, seed: int = 0) -> dict[str, float]:
    """Pieces built up from shorter ones, as BPE training leaves them, with random scores."""
    rng, pieces = random.Random(seed), {}
    for _ in range(count):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 4))).replace(" ", SPACE)
        pieces.setdefault(word, -rng.random() * 100)
    return pieces


def kstep_tokenizer(path: Path) -> tuple[Tokenizer, dict]:
    tokenizer, config = tokenizer_files(GGUFFile(path))
    return Tokenizer.from_str(json.dumps(tokenizer)), config


def test_a_sentencepiece_vocabulary_encodes_as_llama_cpps_tokenizer(tmp_path):
    rng = random.Random(0)
    letters = "abcde \u00e9"  # an accented letter with no token of its own: its bytes
    pieces = random_pieces(300, "abcde ")
    tokenizer, config = kstep_tokenizer(write_spm_vocab(tmp_path / "spm.gguf", pieces))
    vocab = tokenizer.get_vocab()
    scores = [0.0] * len(vocab)
    for piece, score in pieces.items():
        scores[vocab[piece]] = score
    for _ in range(300):
        text = "".join(rng.choice(letters) for _ in range(rng.randint(0, 30)))
        assert tokenizer.encode(text, add_special_tokens=False).ids == llama_cpp_spm(text, vocab, scores), text
        assert tokenizer.decode(tokenizer.encode(text).ids) == text  # the prefix space stripped again
    assert tokenizer.encode("ab").ids[0] == 1 and config["bos_token"] == "<s>"  # add_bos_token: <s> first


# every one of llama.cpp's test vocabularies kstep reads
VOCABULARIES = ["gpt-2", "llama-bpe", "qwen2", "deepseek-coder", "llama-spm", "phi-3"]


@pytest.mark.skipif(not FIXTURES.is_dir(), reason="llama.cpp's tree is not unpacked (scripts/build_llamacpp.sh)")
@pytest.mark.parametrize("name", VOCABULARIES)
def test_each_vocabulary_encodes_llama_cpps_own_test_texts_as_it_does(name):
    path = FIXTURES / f"ggml-vocab-{name}.gguf"
    tokenizer, _ = kstep_tokenizer(path)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text().split("\n")
    assert len(texts) > 40
    for text, ids in zip(texts, expected):
        assert tokenizer.encode(text, add_special_tokens=False).ids == [int(t) for t in ids.split()], repr(text)


def test_a_model_with_a_sentencepiece_vocabulary_runs_and_keeps_to_a_json_schema(tmp_path):
    """A Llama GGUF whose tokenizer is SentencePiece ("\u2581" for spaces, bytes for the rest) loads,
    decodes what it encodes, token healing sees a word's piece with its space (decoded alone, the
    decoder strips it), and llguidance reads its tokenizer.json: output held to a JSON schema parses."""
    from kstep.random_checkpoint import write_random_checkpoint
    pieces = random_pieces(400, "abcdefghij {}\":,0123456789")
    source = write_random_checkpoint(tmp_path / "llama", family="llama", seed=2, vocab_size=259 + len(pieces))
    llm = kstep.load(write_gguf(source, tmp_path / "spm.gguf", "llama", spm=pieces))
    assert llm.tokenizer.decode(llm.tokenizer.encode("abc de")) == "abc de"
    spaced = next(p for p in pieces if p.startswith(SPACE) and len(p) > 1)  # a piece that starts a word
    assert llm.tokenizer._token_texts()[llm.tokenizer.token_to_id(spaced)] == spaced.replace(SPACE, " ")  # healing
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["ab", "cd"]}},
              "required": ["a", "b"], "additionalProperties": False}
    [out] = llm.generate(["{"], max_tokens=48, temperature=0.0, structured=StructuredSpec.json_schema(schema))
    value = json.loads(out.text)
    assert isinstance(value["a"], int) and value["b"] in ("ab", "cd")
