"""The OpenAI-compatible request bodies (pydantic, at the HTTP edge only) and their translation
into GenerationParams. Standard fields follow the OpenAI API reference (defaults included:
temperature 1, top_p 1, completions max_tokens 16) and validate strictly, as OpenAI does: JSON
types, no coercion (`"n": "2"` is a 400). kstep's own knobs are extra fields, generated from their
declaration in GenerationParams."""
import types
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, create_model

from kstep.params import GenerationParams, user_knobs

_STRICT = {int: StrictInt, float: StrictFloat, bool: StrictBool, str: StrictStr}


def _strict(annotation):
    """The strict pydantic type of a knob's annotation (`float | None` -> StrictFloat | None)."""
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
    model: StrictStr
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2)
    top_p: StrictFloat | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
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
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict] | None = None

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
