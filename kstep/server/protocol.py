"""The OpenAI-compatible request bodies (pydantic, at the HTTP edge only) and their translation
into GenerationParams. Standard fields follow the OpenAI API reference (defaults included:
temperature 1, top_p 1, completions max_tokens 16) and validate strictly, as OpenAI does: JSON
types, no coercion (`"n": "2"` is a 400). kstep's own knobs are extra fields, generated from their
declaration in GenerationParams."""
import types
from typing import Annotated, Literal

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, \
    create_model
from pydantic_core import PydanticCustomError

from kstep.params import GenerationParams, user_knobs


def _unicode(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate (the escape "\\ud800", or its raw bytes, which Python's
    JSON decoder lets through): no tokenizer can encode it, so it is a 400 here, not a 500 later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("unicode", "Input should be valid Unicode text (it holds a lone surrogate)") \
            from None
    return text


Text = Annotated[str, Strict(), AfterValidator(_unicode)]
# Python's JSON decoder accepts NaN and Infinity, which slip past every range check (NaN compares false).
Number = Annotated[float, Strict(), AllowInfNan(False)]
_STRICT = {int: StrictInt, float: Number, bool: StrictBool, str: Text}


def _strict(annotation):
    """The strict pydantic type of a knob's annotation (`float | None` -> Number | None)."""
    base = next(a for a in annotation.__args__ if a is not type(None)) \
        if isinstance(annotation, types.UnionType) else annotation
    return _STRICT[base] | None


KSTEP_FIELDS = tuple(f.name for f in user_knobs() if f.metadata["http"])
# kstep's knobs; None = the server's per-model default, else GenerationParams' default
KstepFields = create_model("KstepFields", __config__=ConfigDict(extra="ignore"),
                           **{f.name: (_strict(f.type), None) for f in user_knobs() if f.metadata["http"]})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False
    include_canvas: StrictBool = False     # kstep: chunks carry the whole canvas and the step index


class SamplingFields(KstepFields):
    model: Text
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)  # a torch generator seed (OpenAI: int64)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logprobs: StrictBool | StrictInt | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise ValueError("stop: at most 4 stop sequences")
        if any(s == "" for s in stop):
            raise ValueError("stop: stop sequences must be non-empty")
        return stop

    def unsupported(self) -> str | None:
        """The first standard field kstep does not implement, when it is set to a non-default value."""
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty" if self.presence_penalty else "frequency_penalty"
        if self.logprobs:
            return "logprobs"
        return None

    def generation_params(self, defaults: dict, default_max_tokens: int) -> GenerationParams:
        """GenerationParams from this body over the server's defaults (raises ValueError naming the field)."""
        fields = dict(defaults)
        max_tokens = self.max_completion_tokens if self.max_tokens is None else self.max_tokens
        fields["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
        fields["temperature"] = 1.0 if self.temperature is None else self.temperature
        if self.top_p is not None and self.top_p < 1:
            fields["top_p"] = self.top_p
        if self.seed is not None:
            fields["seed"] = self.seed
        fields.update({name: getattr(self, name) for name in KSTEP_FIELDS if getattr(self, name) is not None})
        if self.exact is None and any(getattr(self, n) is not None for n in ("cache", "threshold", "factor")):
            fields.pop("exact", None)  # a request choosing a cache or policy overrides a server-wide --exact
        return GenerationParams(**fields)


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
