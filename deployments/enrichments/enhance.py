"""Enhance: cheap, pure string clean-up before and after the model.

``prompt_rewrite`` (each message's text, or the bare ``prompt``):

- strips control characters other than newline and tab;
- normalises whitespace: CRLF to LF, runs of spaces and tabs inside a line to one space, trailing
  spaces dropped, three or more newlines to two, the ends trimmed. Leading indentation is kept,
  so code in a prompt keeps its shape;
- collapses repeated ``!``, ``?`` and ``,`` to one, and four or more dots to an ellipsis. Other
  punctuation (``::``, ``==``, ``--``, ``**``) is left alone because it is usually code or markup;
- for ``messages``, prepends ``{"role": "system", "content": SYSTEM_PROMPT}`` when no message has
  the system role.

``response_polish`` normalises whitespace the same way, capitalises the first letter of each
sentence and ends the text with a full stop when it ends in a letter or digit. Text inside
fenced code blocks (```) is left as it is.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from deployments.enrichments.base import Enrichment
from deployments.enrichments.feature import Feature, RequestState, Worker

SYSTEM_PROMPT = "You are a helpful assistant."

_INNER_SPACE = re.compile(r"(?<=\S)[ \t]+(?=\S)")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n{3,}")
_REPEATED_MARK = re.compile(r"([!?,])\1+")
_LONG_DOTS = re.compile(r"\.{4,}")
_SENTENCE_START = re.compile(r"(^|[.!?][\"')\]]*\s+)([a-z])")
_FENCE = re.compile(r"(```.*?(?:```|\Z))", re.DOTALL)


def strip_control(text: str) -> str:
    return "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")


def normalise_whitespace(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _INNER_SPACE.sub(" ", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()


def rewrite_text(text: str) -> str:
    text = normalise_whitespace(strip_control(text))
    return _LONG_DOTS.sub("...", _REPEATED_MARK.sub(r"\1", text))


def polish_text(text: str) -> str:
    parts = _FENCE.split(normalise_whitespace(strip_control(text)))
    for i in range(0, len(parts), 2):  # even parts are prose, odd parts are fenced code
        parts[i] = _SENTENCE_START.sub(lambda m: m.group(1) + m.group(2).upper(), parts[i])
    out = "".join(parts)
    if out and out[-1].isalnum():
        out += "."
    return out


def _rewrite_content(content: Any) -> Any:
    if isinstance(content, str):
        return rewrite_text(content)
    if isinstance(content, list):  # OpenAI content parts: rewrite the text parts only
        return [
            {**p, "text": rewrite_text(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
            for p in content
        ]
    return content


class Enhance(Enrichment):
    features = ("prompt_rewrite", "response_polish")

    def __init__(self, system_prompt: str = SYSTEM_PROMPT) -> None:
        super().__init__()
        self.system_prompt = system_prompt

    async def _call(self, feature: str, payload: dict[str, Any]) -> dict[str, Any]:
        if feature == "response_polish":
            return {"text": polish_text(str(payload.get("text") or ""))}
        if "messages" in payload:
            messages = [
                {**m, "content": _rewrite_content(m.get("content"))} if isinstance(m, dict) else m
                for m in payload["messages"]
            ]
            if not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return {"messages": messages}
        return {"prompt": rewrite_text(str(payload.get("prompt") or ""))}


class EnhanceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    system_prompt: str = SYSTEM_PROMPT


def _apply_rewrite(request: RequestState, result: Mapping[str, Any]) -> None:
    if "messages" in result and request.messages is not None:
        request.messages = list(result["messages"])
    if "prompt" in result and request.prompt is not None:
        request.prompt = result["prompt"]


def _apply_polish(request: RequestState, result: Mapping[str, Any]) -> None:
    request.text = str(result.get("text", request.text))


# Pure string work of microseconds: it runs inside the ingress process, never behind an RPC.
WORKER = Worker("enhance", Enhance, host=None, settings=EnhanceSettings)
PROMPT_REWRITE = Feature("prompt_rewrite", WORKER, apply=_apply_rewrite)
RESPONSE_POLISH = Feature(
    "response_polish", WORKER,
    payload=lambda request: {"text": request.text, "request_id": request.request_id},
    apply=_apply_polish,
)
