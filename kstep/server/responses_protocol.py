"""The Responses API's request body (OpenAI's POST /v1/responses) and its translation into a chat
body (chat_protocol.py), so that a Responses request takes the chat endpoint's path: one prompt
rendering, one set of checks, one grammar for tools and formats. server/responses.py answers it.

Served: `input` (a string, or message / function_call / function_call_output items with text
content), `instructions`, function `tools` (Responses' flat shape), `tool_choice`,
`parallel_tool_calls`, `text.format`, `max_output_tokens`, `temperature`, `top_p`, `stream`, and
kstep's knobs (with `seed`) as extra fields. kstep keeps nothing between requests and has no
built-in tools, so what needs either (`store: true`, `previous_response_id`, `conversation`,
`background`, built-in tools, `include`, ...) is refused by name unless it holds its no-op value."""
import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, StrictBool, StrictInt, Tag
from pydantic_core import PydanticCustomError

from kstep.server.chat_protocol import ChatCompletionRequest
from kstep.server.protocol import ENDPOINTS, KSTEP_FIELDS, KnownFields, KstepFields, Number, Text


def _served_types(what: str, types: tuple[str, ...], default: str | None = None) -> BeforeValidator:
    """Refuse an object whose `type` kstep does not serve, naming it, before its other fields are
    read (a built-in tool's own fields would otherwise be reported as unknown first)."""
    def check(data: Any) -> Any:
        kind = data.get("type", default) if isinstance(data, dict) else None
        if isinstance(data, dict) and kind not in types:
            message = (f"{what} type {kind!r} is not supported by kstep: it takes "
                       f"{', '.join(repr(t) for t in types)}")
            raise PydanticCustomError("unsupported_type", "{message}", {"message": message})
        return data
    return BeforeValidator(check)


class ContentPart(KnownFields):
    """A text part of a message (an assistant's own earlier output included)."""
    where: ClassVar[str] = "input[].content[]"

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list | None = None       # an output_text's, echoed back: kstep writes none
    logprobs: list | None = None
    prompt_cache_breakpoint: Any = None   # a caching hint: no effect on the tokens


TextParts = Annotated[list[Annotated[ContentPart, _served_types("content part", ("input_text", "output_text"))]],
                      Field(min_length=1)]


def _joined(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(KnownFields):
    where: ClassVar[str] = "input[]"

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | TextParts
    id: Text | None = None                # an earlier output item's, echoed back
    status: Text | None = None
    phase: Text | None = None


def _json_object(text: str) -> str:
    try:
        is_object = isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        is_object = False
    if not is_object:
        raise PydanticCustomError("arguments", "a call's arguments are a JSON object's text")
    return text


class FunctionCallItem(KnownFields):
    """A call the model made in an earlier turn."""
    where: ClassVar[str] = "input[]"

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Annotated[Text, AfterValidator(_json_object)]
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(KnownFields):
    """A call's result, as the client's code returned it."""
    where: ClassVar[str] = "input[]"

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | TextParts
    id: Text | None = None
    status: Text | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output")
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(lambda data: data.get("type", "message") if isinstance(data, dict) else getattr(data, "type", None),
                  custom_error_type="invalid_item", custom_error_message="an input item is a JSON object"),
    _served_types("input item", ITEM_TYPES, default="message")]


class FunctionTool(KnownFields):
    """A function tool in Responses' flat shape; the fields for tool search and programmatic
    calling are refused unless they hold their no-op value."""
    where: ClassVar[str] = "tools[]"

    type: Literal["function"]
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None  # kstep enforces the parameters either way
    defer_loading: Literal[False] | None = None
    allowed_callers: list[Literal["direct"]] | None = None
    output_schema: dict | None = None  # describes what the client's code returns: no effect on the call

    def chat_dict(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamedFunction(KnownFields):
    where: ClassVar[str] = "tool_choice"

    type: Literal["function"]
    name: Text


class TextFormat(KnownFields):
    """`text.format`: OpenAI's response_format, flattened (name and schema beside the type)."""
    where: ClassVar[str] = "text.format"

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.name is None or self.schema_ is None:
            raise ValueError("text.format: type json_schema needs its name and schema")
        schema = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(KnownFields):
    where: ClassVar[str] = "text"

    format: TextFormat | None = None
    verbosity: Any = None  # refused unless absent (REFUSED)


class ResponsesStreamOptions(KnownFields):
    where: ClassVar[str] = "stream_options"

    include_obfuscation: StrictBool | None = None  # OpenAI's padding of stream events: kstep sends none


def _no_reasoning(value) -> bool:
    return value is None or (isinstance(value, dict) and all(v is None for v in value.values()))


# Fields kstep cannot honour, each with the test that a value is its no-op and why any other is refused.
KEEPS_NOTHING = "it keeps no responses: send the earlier turns' items in `input`"
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (lambda v: v is None or v is False, "it keeps no responses, so none could be retrieved: "
                                                 "send store false or leave it out"),
    "previous_response_id": (lambda v: v is None, KEEPS_NOTHING),
    "conversation": (lambda v: v is None, KEEPS_NOTHING),
    "background": (lambda v: v is None or v is False, "it answers in the request itself"),
    "include": (lambda v: not v, "it has nothing more to include (no logprobs, reasoning or built-in tools)"),
    "reasoning": (_no_reasoning, "its models have no separate reasoning to configure"),
    "prompt": (lambda v: v is None, "it keeps no prompt templates: send the input itself"),
    "top_logprobs": (lambda v: v is None or v == 0, "it returns no logprobs"),
    "truncation": (lambda v: v is None or v == "disabled", "it never drops input: a too-long one is a 400"),
    "context_management": (lambda v: not v, "it does not compact a conversation"),
    "moderation": (lambda v: v is None, "it does not moderate"),
}
# OpenAI fields with no effect on the tokens (bookkeeping, caching hints; max_tool_calls counts
# built-in tools' calls, which kstep has none of): accepted, not used.
IGNORED = ("metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
           "prompt_cache_retention", "max_tool_calls")


class ResponsesRequest(KnownFields, KstepFields):
    where: ClassVar[str] = "/v1/responses"

    model: Text
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[Annotated[FunctionTool, _served_types("tool", ("function",))]] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedFunction,
                           _served_types("tool_choice", ("function",))] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)  # kstep's (Responses has none): as chat's
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    store: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    include: Any = None
    reasoning: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    context_management: Any = None
    moderation: Any = None
    metadata: dict[Text, Text] | None = None
    user: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    max_tool_calls: Any = None

    def refused(self) -> tuple[str, str] | None:
        """The first field given that kstep cannot honour (its no-op aside), and why: (field, message)."""
        if self.text is not None and self.text.verbosity is not None:
            return "text", "text.verbosity is not supported by kstep: its models have no verbosity setting"
        for name, (is_no_op, why) in REFUSED.items():
            if name in self.model_fields_set and not is_no_op(getattr(self, name)):
                return name, f"{name} is not supported by kstep: {why}"
        return None

    def ignored(self) -> list[str]:
        return sorted(set(IGNORED) & self.model_fields_set)

    def chat_body(self) -> ChatCompletionRequest:
        """The same request as a chat body (raises ValueError naming this body's field; a pydantic
        ValidationError only where the chat body checks more than this one does)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.messages(), "stream": self.stream}
        if self.tools is not None:
            fields["tools"] = [t.chat_dict() for t in self.tools]
        if isinstance(self.tool_choice, NamedFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        given = {"parallel_tool_calls": self.parallel_tool_calls, "max_tokens": self.max_output_tokens,
                 "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                 **{name: getattr(self, name) for name in KSTEP_FIELDS}}
        fields.update({name: value for name, value in given.items() if value is not None})
        return ChatCompletionRequest.model_validate(fields)

    def messages(self) -> list[dict]:
        """`instructions` and `input` as chat messages: an assistant's calls join its message (or
        start one), each call's output is a tool message."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _joined(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)})
        if not messages:
            raise ValueError("input: give at least one item (or instructions)")
        return messages


ENDPOINTS.append(ResponsesRequest)
