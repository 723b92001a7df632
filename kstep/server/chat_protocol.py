"""The chat endpoint's request body (OpenAI's /v1/chat/completions): its messages (an assistant's
earlier tool calls and the tools' results included), the tools it may call and how (server/tools.py
keeps them with a grammar), over the sampling fields every endpoint shares (protocol.py)."""
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool

from kstep.server.protocol import ENDPOINTS, KnownFields, SamplingFields, Text
from kstep.server.tools import tool_spec
from kstep.structured import StructuredSpec


class ToolFunction(KnownFields):
    where: ClassVar[str] = "tools[].function"

    name: Annotated[str, Strict(), Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None  # kstep enforces the parameters either way


class Tool(KnownFields):
    where: ClassVar[str] = "tools[]"

    type: Literal["function"]
    function: ToolFunction


class NamedFunction(KnownFields):
    where: ClassVar[str] = "tool_choice.function"

    name: Text


class NamedToolChoice(KnownFields):
    where: ClassVar[str] = "tool_choice"

    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(BaseModel):
    name: Text
    arguments: Text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a client may echo a reply's fields (refusal, annotations)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: Text | None = None           # a tool result's call
    name: Text | None = None

    def prompt_dict(self) -> dict:
        """The message as a chat template reads it."""
        out = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

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
    where: ClassVar[str] = "/v1/chat/completions"

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # OpenAI's chat fields kstep does not honour (fields.py: refused unless their no-op, or ignored)
    top_logprobs: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    prediction: Any = None

    def tool_dicts(self) -> list[dict] | None:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_name(self) -> str:
        """"none", "auto", "required" or the named function (OpenAI's default: "auto" with tools)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")

    def structured(self) -> StructuredSpec | None:
        """The tools' grammar (server/tools.py) around the answer's own structured output."""
        text = super().structured()
        choice = self.tool_choice_name()
        if choice != "none" and not self.tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if not self.tools:
            return text
        if self.structured_outputs is not None and choice != "none":
            raise ValueError("structured_outputs: with tools, an answer's format is response_format's")
        return tool_spec(self.tool_dicts(), choice, self.parallel_tool_calls is not False, text)


ENDPOINTS.append(ChatCompletionRequest)
