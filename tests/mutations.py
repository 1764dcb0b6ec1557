"""Hypothesis strategies for the mutation fuzz: a valid request body with 1-3 random mutations.

Shared by the unit fuzz (against `serve_app.openai_api.parse_body`) and the live one (against a
deployment). A mutation is one of: a field set to a wrong type, to an extreme number (2**64,
-2**63-1, 1e308, NaN, Infinity, ...), to JSON nested thousands of levels deep, to a string holding
a lone surrogate escape (``"\\ud800"``, in a message's content, ``stop``, ``user``, a key, ...), an
unknown field added, a required field removed, a huge ``stop`` list or string. The result is the
raw bytes sent: deep nesting is spliced into the text (``json.dumps`` itself would recurse), and
NaN and Infinity are written as Python's JSON writes them (not standard JSON, but what a careless
client sends).
"""

from __future__ import annotations

import copy

import json
from typing import Any

from hypothesis import strategies as st

MODEL = "brownout-tiny"
SURROGATES = ["\ud800", "\udfff", "\udc80", "a\ud83db"]  # lone halves; "a\ud83db" has a high one inside
EXTREME_NUMBERS: list[Any] = [
    2**64, -(2**63) - 1, 2**63, 10**30, -(10**30), 1e308, -1e308, 5e-324, float("nan"), float("inf"),
    float("-inf"), 0, -1, 1.5, 2**31, 2**53 + 1,
]
WRONG_TYPES: list[Any] = [None, True, "text", 3, -7.25, [], {}, [1, "a"], {"a": {"b": 1}}, ""]
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "seed", "user", "presence_penalty", "frequency_penalty", "ignore_eos",
    "min_tokens", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "allowed_token_ids",
    "bad_words", "logprobs", "tools", "logit_bias", "metadata", "echo", "priority", "best_of",
]
DEEP = "\x00deep:{}\x00"  # a placeholder string the serializer turns into nested brackets


def valid_chat(max_tokens: int = 4) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say hi."}],
            "max_tokens": max_tokens, "temperature": 0.5, "stop": ["\n\n"], "user": "fuzz"}


def valid_completion(max_tokens: int = 4) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.5}


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``doc`` a value sits at (dict keys and list indexes), the root excluded."""
    out: list[tuple[Any, ...]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _mutate(draw: Any, doc: dict[str, Any]) -> str:
    kind = draw(st.sampled_from(["wrong_type", "extreme", "deep", "surrogate", "unknown", "missing",
                                 "huge_stop", "nested_wrong"]))
    field = draw(st.sampled_from(FIELDS))
    if kind == "wrong_type":
        doc[field] = copy.deepcopy(draw(st.sampled_from(WRONG_TYPES)))  # shared values would make cycles
    elif kind == "extreme":
        doc[field] = draw(st.sampled_from(EXTREME_NUMBERS))
    elif kind == "deep":
        doc[field] = DEEP.format(draw(st.sampled_from([33, 100, 1000, 5000, 20000])))
    elif kind == "surrogate":
        where = draw(st.sampled_from(["content", "stop", "user", "model", "key", "prompt", "anywhere"]))
        bad = draw(st.sampled_from(SURROGATES))
        if where == "content" and "messages" in doc and isinstance(doc["messages"], list) and doc["messages"]:
            msg = doc["messages"][-1]
            if isinstance(msg, dict):
                msg["content"] = bad
        elif where == "key":
            doc[bad] = 1
        elif where == "anywhere":
            strings = [p for p in _paths(doc) if isinstance(_get(doc, p), str)]
            if strings:
                _set(doc, draw(st.sampled_from(strings)), bad)
        else:
            doc[where] = [bad] if where == "stop" and draw(st.booleans()) else bad
    elif kind == "unknown":
        doc[draw(st.sampled_from(["foo", "functions_v2", "max_tokens ", "Model", "__proto__"]))] = 1
    elif kind == "missing":
        doc.pop(draw(st.sampled_from(["model", "messages", "prompt"])), None)
    elif kind == "huge_stop":
        n = draw(st.sampled_from([5, 100, 10_000]))
        doc["stop"] = ["x"] * n if draw(st.booleans()) else "s" * (n * 10)
    else:  # a wrong type one level down: inside a message or a stream_options
        paths = [p for p in _paths(doc) if len(p) >= 2]
        if paths:
            _set(doc, draw(st.sampled_from(paths)), copy.deepcopy(draw(st.sampled_from(WRONG_TYPES + EXTREME_NUMBERS))))
    return kind


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def serialize(doc: Any) -> bytes:
    """JSON text of ``doc`` (lone surrogates as escapes, NaN/Infinity as Python writes them),
    with each deep-nesting placeholder replaced by that many nested arrays."""
    text = json.dumps(doc, ensure_ascii=True)
    while '"\\u0000deep:' in text:
        start = text.index('"\\u0000deep:')
        end = text.index('\\u0000"', start + 1)
        depth = int(text[start + len('"\\u0000deep:'):end])
        text = text[:start] + "[" * depth + "]" * depth + text[end + len('\\u0000"'):]
    return text.encode("ascii")


@st.composite
def mutated_bodies(draw: Any, chat: bool | None = None, max_tokens: int = 4) -> tuple[bytes, list[str]]:
    """(raw body, the mutation kinds applied): a valid body with 1-3 mutations."""
    is_chat = draw(st.booleans()) if chat is None else chat
    doc = valid_chat(max_tokens) if is_chat else valid_completion(max_tokens)
    kinds = [_mutate(draw, doc) for _ in range(draw(st.integers(1, 3)))]
    return serialize(doc), kinds


MALFORMED_UTF8 = [
    b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
    b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
    b'{"model": "brownout-tiny", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',  # raw surrogate
    b'{"model": "brownout-tiny", "prompt": "\xf8\x88\x80\x80\x80"}',
    b"\xef\xbb\xbf{}",
]
