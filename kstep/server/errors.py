"""How `kstep serve` says no: OpenAI-style error bodies (`{"error": {message, type, param, code}}`)
for every failure, a body-size limit, and handlers that turn any bad input into a 4xx naming the
field, so no input reaches a 500 and a bad request never reaches the engine."""
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kstep.server.metrics import Metrics


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def param_named_in(message: str, known: set[str]) -> str | None:
    """The request field a GenerationParams error names first (its messages start with it)."""
    word = re.match(r"[a-z_]+", message)
    return word.group(0) if word and word.group(0) in known else None


class BodySizeLimit:
    """ASGI middleware: refuse bodies over the limit (413) before they are read into memory."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = APIError(413, f"request body exceeds the server's limit of {self.max_bytes} bytes",
                           code="body_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise too_big
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError as e:
            await e.response()(scope, receive, send)


def _body_path(loc: tuple, body) -> str:
    """Where in the body an error is, as the client wrote it ("messages[0].role"). Pydantic's loc also
    names each union member it tried ("prompt.list[int].0"): those parts are not in the body."""
    path, value = "", body
    for i, part in enumerate(loc):
        if isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            path, value = f"{path}[{part}]", value[part]
        elif isinstance(value, dict) and (part in value or i == len(loc) - 1):  # the last may be missing
            path, value = f"{path}.{part}" if path else str(part), value.get(part)
    return path


def _validation_message(e: RequestValidationError) -> APIError:
    errors = [{**err, "loc": tuple(err.get("loc", ()))[1:]} for err in e.errors()]  # drop the leading "body"
    if not errors:
        return APIError(400, "invalid request")
    field = errors[0]["loc"][0] if errors[0]["loc"] else None  # the top-level field: OpenAI's `param`
    # A union reports one failure per member; the one that got deepest is the form the client meant.
    first = max((err for err in errors if err["loc"][:1] == errors[0]["loc"][:1]), key=lambda err: len(err["loc"]))
    path = _body_path(first["loc"], getattr(e, "body", None))
    kind = first.get("type")
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    if kind == "missing" and not first["loc"]:
        return APIError(400, "the request body is empty: send a JSON object")
    if kind == "missing":
        return APIError(400, f"missing required field {path!r}", field)
    if kind == "unknown_field":  # protocol.KnownFields: the field is named, with its likely meaning
        return APIError(400, f"{path}: {first['msg']}" if path else first["msg"], field or first["ctx"]["field"],
                        "unknown_field")
    if kind == "model_attributes_type" and isinstance(first.get("input"), bytes):
        # FastAPI parses JSON only under a JSON content type; any other arrives as raw bytes
        return APIError(415, "the request body must be JSON, sent with 'Content-Type: application/json'")
    if kind == "model_attributes_type":  # the body is JSON but not an object
        return APIError(400, "the request body must be a JSON object")
    return APIError(400, f"{path or 'body'}: {first['msg']}", field)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        # the served model it named, once routed ("" before: an unknown name is no label value)
        metrics.observe_request(getattr(request.state, "model", ""), str(e.status))
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        # refused before routing, but a body that names a served model is that model's error
        body = getattr(e, "body", None)
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model in request.app.state.routes.by_name:
            request.state.model = model
        return await api_error(request, _validation_message(e))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        # FastAPI's own 4xx (a body it cannot decode, e.g. not UTF-8; an unknown route or method)
        message = "the request body is not valid UTF-8 JSON" if e.detail == "There was an error parsing the body" \
            else str(e.detail)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return await api_error(request, APIError(e.status_code, message, kind=kind))
