"""What each proxy route answers, for its OpenAPI document: success models, error statuses, event streams.

Statuses, by where they come from: 401/403/410 from the key check (`auth.KeyCheck`, before the body), and
421 there too when a pool's worker is sent another worker's session key (`pipeline.proxy.pool`),
413 from the body limit (`http.BodyLimit`), 400 from body validation, 404/409/429 from the session store,
502/503 when the inference servers fail (`core`). The fuzz suites check the document against the server
(Schemathesis' status-code, content-type and response-schema conformance), so a new status must be
declared here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pipeline.net.apidoc import STATUS_TEXT, errors, ref, sse_stream
from schemas.api.answers import (
    AnthropicError,
    AnthropicMessageObject,
    CapacityAnswer,
    ChatCompletion,
    ChatCompletionChunk,
    EndAnswer,
    ExportAnswer,
    Health,
    MessageEvent,
    ModelList,
    OpenAIError,
    ResponseEvent,
    ResponseObject,
    RewardAnswer,
)
from schemas.api.rl import StartSessionResponse

KEYED = (401, 403, 410, 421)
BODY = (400, 413)
Responses = dict[int | str, dict[str, Any]]


def answers(model: type[BaseModel], *statuses: int) -> Responses:
    """FastAPI `responses` of a route answering `model` (200) or an OpenAI-shaped error."""
    return {200: {"model": model, "description": "Done"}, **errors(OpenAIError, *statuses)}


HEALTH = answers(Health)
MODELS = answers(ModelList, *KEYED)
GRANT = answers(CapacityAnswer, *BODY, *KEYED)
START = answers(StartSessionResponse, *BODY, *KEYED, 429)
SET_REWARD = answers(RewardAnswer, *BODY, *KEYED, 404)
END = answers(EndAnswer, *BODY, *KEYED, 404, 409, 503)
EXPORT = answers(ExportAnswer, *BODY, *KEYED, 404, 409)


def llm_call(
    answer: type[BaseModel],
    event: dict[str, Any],
    error: type[BaseModel],
    *,
    done_marker: bool,
    statuses: tuple[int, ...] = (),
) -> tuple[dict[str, Any], tuple[type[BaseModel], ...]]:
    """The OpenAPI responses of an LLM route (a raw post: written out, not built by FastAPI) and their models."""
    content = {"application/json": {"schema": ref(answer)}, **sse_stream(event, done_marker=done_marker)}
    ok = {"description": "The answer, or with stream=true its Server-Sent Events", "content": content}
    failed = {
        str(s): {"description": STATUS_TEXT[s], "content": {"application/json": {"schema": ref(error)}}}
        for s in (*BODY, *KEYED, *statuses, 502, 503)
    }
    return {"200": ok, **failed}, (answer, error)


# A stream that fails after its headers reports the error in-band, in the API's error shape.
CHAT = llm_call(ChatCompletion, {"anyOf": [ref(ChatCompletionChunk), ref(OpenAIError)]}, OpenAIError, done_marker=True)
RESPONSES = llm_call(ResponseObject, ref(ResponseEvent), OpenAIError, done_marker=False, statuses=(404,))
MESSAGES = llm_call(AnthropicMessageObject, ref(MessageEvent), AnthropicError, done_marker=False)
EVENT_MODELS = (ChatCompletionChunk, ResponseEvent, MessageEvent)
