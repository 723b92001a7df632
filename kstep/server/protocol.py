"""The OpenAI-compatible request bodies (pydantic, at the HTTP edge only; the chat body in chat_protocol.py) and their translation
into GenerationParams. Standard fields follow the OpenAI API reference (defaults included:
temperature 1, top_p 1, completions max_tokens 16) and validate strictly, as OpenAI does: JSON
types, no coercion (`"n": "2"` is a 400). kstep's own knobs are extra fields, generated from their
declaration in GenerationParams. A field a body does not declare is a 400 naming it, and the OpenAI
fields kstep does not honour are declared to be refused or ignored by name (fields.py)."""
import types
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, \
    create_model, model_validator
from pydantic_core import PydanticCustomError

from kstep.params import GenerationParams, user_knobs
from kstep.server.fields import IGNORED, first_unsupported, unknown_field_message
from kstep.server.structured_fields import structured_spec
from kstep.structured import StructuredSpec


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
KstepFields = create_model("KstepFields", __config__=ConfigDict(extra="forbid"),
                           **{f.name: (_strict(f.type), None) for f in user_knobs() if f.metadata["http"]})


class KnownFields(BaseModel):
    """A body whose every field is declared: any other is refused before the rest is validated,
    naming it (`where`: the endpoint or nested object, for the message)."""
    where: ClassVar[str] = "the request body"

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data):
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()}
            for name in data:
                if name not in known:
                    message = unknown_field_message(name, set(cls.model_fields), cls.where, _elsewhere(cls))
                    raise PydanticCustomError("unknown_field", "{message}", {"message": message, "field": name})
        return data


def _elsewhere(cls: type) -> dict[str, set[str]]:
    """The other endpoints' fields, for a field sent to the wrong one."""
    return {c.where: set(c.model_fields) for c in ENDPOINTS if not issubclass(cls, c)}


ENDPOINTS: list[type] = []  # the endpoints' request bodies (this module's and chat_protocol.py's), as declared


class StreamOptions(KnownFields):
    where: ClassVar[str] = "stream_options"

    include_usage: StrictBool = False
    include_obfuscation: StrictBool | None = None  # OpenAI's padding of stream chunks: kstep sends none
    include_canvas: StrictBool = False     # kstep: chunks carry the whole canvas and the step index


class JsonSchemaFormat(KnownFields):
    where: ClassVar[str] = "response_format.json_schema"

    name: Text
    description: Text | None = None
    schema_: dict | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(KnownFields):
    """OpenAI's response_format (structured_fields.py reads it)."""
    where: ClassVar[str] = "response_format"

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(KnownFields):
    """vLLM's structured_outputs (structured_fields.py reads it: one of the first five)."""
    where: ClassVar[str] = "structured_outputs"

    json_: dict | StrictBool | Text | None = Field(default=None, alias="json")  # (BaseModel has a .json)
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: StrictBool | None = None
    disable_fallback: StrictBool | None = None        # kstep never falls back to free text
    disable_any_whitespace: StrictBool | None = None  # kstep's JSON has json.dumps's spaces only
    disable_additional_properties: StrictBool | None = None
    whitespace_pattern: Text | None = None
    structural_tag: Any = None


class SamplingFields(KnownFields, KstepFields):
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
    logit_bias: dict[Text, Number] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > 4:
            raise ValueError("stop: at most 4 stop sequences")
        if any(s == "" for s in stop):
            raise ValueError("stop: stop sequences must be non-empty")
        return stop

    def unsupported(self) -> str | None:
        """The first OpenAI field kstep does not implement, when it is set to other than its no-op value."""
        return first_unsupported({name: getattr(self, name) for name in self.model_fields_set})

    def ignored(self) -> list[str]:
        """The OpenAI fields given that have no effect on the output (accepted, not used)."""
        return sorted(set(IGNORED) & self.model_fields_set)

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
        fields["structured"] = self.structured()
        if self.logit_bias:
            if not all(k.isdigit() for k in self.logit_bias):
                raise ValueError(f"logit_bias: keys are token ids, got {next(k for k in self.logit_bias if not k.isdigit())!r}")
            fields["logit_bias"] = tuple((int(k), float(v)) for k, v in self.logit_bias.items())
        return GenerationParams(**fields)

    def asks_structured(self) -> bool:
        """Whether the body asks for a structured output or tool calls (its metrics count it)."""
        wants_format = self.response_format is not None and self.response_format.type != "text"
        return wants_format or self.structured_outputs is not None or bool(getattr(self, "tools", None))

    def structured(self) -> StructuredSpec | None:
        """The structured output the body asks for (structured_fields.py), or None."""
        return structured_spec(self.response_format, self.structured_outputs)


class CompletionRequest(SamplingFields):
    where: ClassVar[str] = "/v1/completions"

    prompt: Text | list[Text] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: Text | None = None
    best_of: Any = None


ENDPOINTS.append(CompletionRequest)
