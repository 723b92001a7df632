"""A GGUF file's tokenizer (tokenizer.ggml.*) as the tokenizer.json and tokenizer_config.json the
`tokenizers` library and kstep read: a byte-level BPE ("gpt2") with its tokens, merges and special
tokens, and the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`, written as the Hugging Face
tokenizer it was converted from writes it (llama.cpp's src/llama-vocab.cpp has the same regexes); or
a SentencePiece BPE ("llama": Llama 2, Mistral) as transformers' LlamaConverter writes one, its merges
ranked by the merged piece's score, as llama.cpp's tokenizer merges the best-scored pair first."""
from kstep.gguf.reader import GGUFFile

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values (gguf.TokenType)

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def _splits_then_bytes(*patterns: str) -> dict:
    """Splits on each regex in turn, then byte-level without its own regex: llama.cpp's list of regexes
    for one name, each applied to the pieces the one before left (as Qwen2's, Llama 3's and DeepSeek
    Coder's tokenizer.json ship)."""
    splits = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False} for p in patterns]
    return {"type": "Sequence", "pretokenizers": [*splits, {**_BYTE_LEVEL, "use_regex": False}]}


_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "gpt-2": _BYTE_LEVEL,
    "qwen2": _splits_then_bytes(_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")),
    "llama-bpe": _splits_then_bytes(_LLAMA3),
    "llama3": _splits_then_bytes(_LLAMA3),
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "deepseek-coder": _splits_then_bytes(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+",
                                         "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
}
NFC = ("qwen2",)  # Qwen2's tokenizer.json normalizes to NFC first (llama.cpp does not: the same ids for NFC text)
IGNORES_MERGES = ("llama-bpe", "llama3")  # llama.cpp's LLAMA3 type: a whole word in the vocabulary is one token


def tokenizer_files(file: GGUFFile) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json), or a ValueError naming what kstep cannot read."""
    model, pre = file.get("tokenizer.ggml.model"), file.get("tokenizer.ggml.pre", "gpt-2")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"{file.path}: tokenizer model {model!r} is not supported from GGUF files (kstep reads "
                         "byte-level BPE, tokenizer.ggml.model 'gpt2', and SentencePiece BPE, 'llama')")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ValueError(f"{file.path}: pre-tokenizer {pre!r} is not supported from GGUF files "
                         f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = file.get("tokenizer.ggml.tokens")
    types = file.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = file.get("tokenizer.ggml.merges") or []
    special = (CONTROL, UNKNOWN) if model == "llama" else (CONTROL,)
    added = [{"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": kind not in special, "special": kind in special}
             for i, (token, kind) in enumerate(zip(tokens, types, strict=True)) if kind in (*special, USER_DEFINED)]
    bos = file.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(file.get("tokenizer.ggml.add_bos_token", model == "llama")) and bos is not None
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "post_processor": _bos_template(tokens[bos], bos) if add_bos else None}
    if model == "llama":
        tokenizer.update(_sentencepiece(file, tokens))
    else:
        tokenizer.update({
            "normalizer": {"type": "NFC"} if pre in NFC else None,
            "pre_tokenizer": PRE_TOKENIZERS[pre],
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": pre in IGNORES_MERGES, "vocab": {t: i for i, t in enumerate(tokens)},
                      "merges": [m.split(" ", 1) for m in merges]}})
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding"),
                      ("unk_token", "unknown"), ("mask_token", "mask")):
        token_id = file.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    template = file.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tokenizer, config


def _bos_template(bos: str, bos_id: int) -> dict:
    """A post-processor that puts the bos token first, as tokenizers whose add_bos_token is set do."""
    return {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}


def _sentencepiece(file: GGUFFile, tokens: list[str]) -> dict:
    """A SentencePiece BPE vocabulary as transformers' LlamaConverter writes it: " " as "▁" and one
    "▁" before the text (llama.cpp's add_space_prefix), no pre-tokenizer, unknown text as its bytes
    (<0xXX> tokens), and merges from the scores: every split of a piece into two pieces of the
    vocabulary, ranked by the piece's score, best first (SentencePieceExtractor)."""
    scores = file.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for piece, score in sorted(zip(tokens, scores), key=lambda piece_score: -piece_score[1]):  # stable: ids
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(splits, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    prefix = file.get("tokenizer.ggml.add_space_prefix", True)
    unk = file.get("tokenizer.ggml.unknown_token_id")
    unk = unk if unk is not None and 0 <= unk < len(tokens) else None
    normalizers = ([{"type": "Prepend", "prepend": "▁"}] if prefix else []) + \
        [{"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]
    decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])
    return {"normalizer": {"type": "Sequence", "normalizers": normalizers}, "pre_tokenizer": None,
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": None, "unk_token": tokens[unk] if unk is not None else None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                      "byte_fallback": True, "ignore_merges": False, "vocab": vocab, "merges": merges}}
