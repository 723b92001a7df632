"""Text <-> token ids via the `tokenizers` library, and the checkpoint's chat template.

Special ids are read from the checkpoint (tokenizer.json / tokenizer_config.json), never from
literals. The chat template is rendered in jinja2's sandbox: it is data from the checkpoint.
"""
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kstep.weights import read_json

# End-of-turn markers used by common chat formats; looked up in the checkpoint's own vocabulary.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_turn|>", "<end_of_turn>", "<|endoftext|>", "<|eot|>")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise(message: str):
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, path: Path):
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.is_file() else {}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.special = {name: _token_text(self.config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        self._shown: dict[int, str] = {}  # token_text's cache: canvas views decode every position every step
        self._texts: list[str] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_id(self, name: str) -> int | None:
        """Id of tokenizer_config's `bos_token` / `eos_token` / `pad_token`, if set."""
        text = self.special.get(name)
        return None if text is None else self.token_to_id(text)

    def end_of_turn_ids(self) -> list[int]:
        ids = [self.special_id("eos_token"), *(self.token_to_id(t) for t in END_OF_TURN_TOKENS)]
        return [i for i in ids if i is not None]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's text as `decode` shows it (special tokens hidden, U+FFFD for part of a multi-byte
        character), cached; `_token_texts` is the raw text of every token, for healing."""
        text = self._shown.get(token)
        if text is None:
            text = self._shown[token] = self.decode([token])
        return text

    def heal(self, ids: list[int]) -> tuple[list[int], str, list[int]]:
        """Token healing (Microsoft guidance; Lundberg 2023): a prompt ending mid-token (a trailing
        newline or space, which byte-level BPE merges with what follows) ends on a boundary the model
        rarely saw. Back up over the last token when a longer token starts with its text: returns
        (the shorter ids, the text given back, the ids the first generated token may take: those whose
        text starts with it). A prompt whose last token no longer token extends is unchanged ("", [])."""
        if len(ids) < 2 or ids[-1] in self._special_ids():
            return ids, "", []
        texts = self._token_texts()
        removed = texts[ids[-1]]
        if "\ufffd" in removed:  # part of a UTF-8 character: text comparison cannot tell its continuations
            return ids, "", []
        allowed = [i for i, text in enumerate(texts) if text.startswith(removed)] if removed else []
        if len(allowed) < 2:
            return ids, "", []
        return ids[:-1], removed, allowed

    def _special_ids(self) -> set[int]:
        return {i for i, token in self._tok.get_added_tokens_decoder().items() if token.special}

    def _token_texts(self) -> list[str]:
        """Each id's text as it reads after other text (built once): what healing compares. Decoded after
        a first token and cut from it: a SentencePiece decoder strips the space a piece starts with at
        the start of a text ("\u2581then" alone reads "then", after "a" " then")."""
        if self._texts is None:
            first = (self._tok.encode("a", add_special_tokens=False).ids or [0])[:1]
            lead = self._tok.decode(first, skip_special_tokens=False)
            texts = (self._tok.decode(first + [i], skip_special_tokens=False) for i in range(self.vocab_size))
            self._texts = [text[len(lead):] if text.startswith(lead) else text for text in texts]
        return self._texts

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render messages (and the tools they may call) with the checkpoint's chat template (HF
        semantics: trim/lstrip blocks; `tools` as transformers passes them)."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template (tokenizer_config.json: chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            **{k: v or "" for k, v in self.special.items()})


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships without tokenizer.json (ids only)."""
    return Tokenizer(path) if (path / "tokenizer.json").is_file() else None
