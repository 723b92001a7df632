"""The OpenAI-compatible request bodies (pydantic, at the HTTP edge only) and their translation
into GenerationParams. Standard fields follow the OpenAI API reference (defaults included:
temperature 1, top_p 1, completions max_tokens 16); kstep's diffusion knobs are extra fields."""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kstep.params import GenerationParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    include_canvas: bool = False     # kstep: chunks carry the whole canvas and the step index


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    # kstep's knobs (diffusion decoding); None = the server's per-model default
    top_k: StrictInt | None = None
    steps: StrictInt | None = None
    block_length: StrictInt | None = None
    remasking: str | None = None
    threshold: float | None = None
    factor: float | None = None
    cache: str | None = None
    exact: bool | None = None           # LLaDA's reference sampler instead of dual cache + threshold
    cfg_scale: float | None = None
    early_stop: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: StrictInt | None = None         # vLLM's: no stop token among the first min_tokens
    num_draft_tokens: StrictInt | None = None   # AR with a --draft: speculative tokens per pass (0 = off)

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
        for name in ("seed", "top_k", "steps", "block_length", "remasking", "threshold", "factor", "cache",
                     "exact", "cfg_scale", "early_stop", "ignore_eos", "min_tokens",
                     "num_draft_tokens"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.exact is None and any(getattr(self, n) is not None for n in ("cache", "threshold", "factor")):
            fields.pop("exact", None)  # a request choosing a cache or policy overrides a server-wide --exact
        return GenerationParams(**fields)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

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
