"""Level-driven request shaping: at a high level, cap output tokens, refuse costly fields and
stream in larger increments.

Pure: no Ray, no clock, no I/O. `ShapingPlan.from_config` precomputes, once per policy load,
what every level shapes; `shape(plan, level, fields)` is then a few dictionary reads per request.

The rule, and why:

- **Per level, in the policy** (``levelN.shape``, validated in `policies.config`)::

      level2: {shape: {max_tokens: 128, stream_interval: 4}}
      level3: {shape: {max_tokens: 64, refuse: [logprobs, n], stream_interval: 8}}

- **Inherited upward, like disabled features.** At level L the cap on output tokens is the one of
  the highest level <= L that sets one, and a field refused at any level <= L is refused at L.
  A cap may not grow with the level (config rejects it), so a higher level never shapes less:
  shaping is monotone in the level. Level 0 never shapes; neither does a level without ``shape``
  above a level without one.
- **Cap output tokens: shorter answers drain the queue faster.** Decode time, and the time a
  request holds a batch slot and its KV cache, grows with the tokens it generates, so the
  completion rate that admission measures (`policies.admission`) and the backlog it can clear
  within the SLO grow as the cap falls. The cap applies only to a request that asks for more
  (its ``max_tokens`` or ``max_completion_tokens``, after the server's default is filled in); a
  request at or under the cap is untouched. ``min_tokens`` above the cap is lowered to it (vLLM
  rejects ``min_tokens > max_tokens``). The answer then ends with ``finish_reason: "length"``,
  as any capped completion does, so clients already handle it.
- **Stream in larger increments: token-by-token streaming is optional work.** Each increment of
  a streamed answer is one item through every hop (the engine's output processor, the model
  replica's stream to the ingress, one SSE event, the proxy's ASGI message). In increments of 8
  those three processes spent 30-37% less CPU per 16-token request at level 3 on a 2-core
  machine, and latency fell with it (`bench/stream_shaping.py`, bench/RESULTS.md); the engine's
  own work is the same. At a level with ``stream_interval: k`` a streamed request's tokens come
  in increments of k (vLLM's per-request ``SamplingParams.stream_interval``): the first token
  and the last increment are still sent the moment they exist, so neither the time to the
  first token nor the end-to-end latency grows; only the text between them arrives in fewer,
  larger pieces. The answer itself is unchanged (so the semantic cache's scope, which reads the
  sampling settings, is too). A request that does not stream, or whose interval (the engine's
  ``model.stream_interval``) is already at least k, is untouched.
- **Refuse what costs extra.** ``n > 1`` and ``best_of > 1`` generate several sequences for one
  request; ``logprobs`` / ``top_logprobs`` and ``prompt_logprobs`` add per-token work and a
  larger answer. Serving them under overload spends capacity on extras while other requests are
  being refused outright. A value that asks for nothing (``n: 1``, ``logprobs: false`` or 0,
  ``top_logprobs: 0``, null) is never refused.
- **Refused with 400, naming the field and the level**, in OpenAI's error JSON
  (``invalid_request_error``, ``param`` the field, ``code`` ``not_served_at_level``), e.g.
  ``logprobs=true is not served at brownout level 3 ...``. Not 429/503: OpenAI's SDKs (and most
  OpenAI-compatible clients) retry 429 and every 5xx automatically, with the same body, which
  would be refused again and would add load exactly while the service sheds it; a 400 is not
  retried, reaches the caller at once, and tells it the one change that gets it served now
  (drop the field). The message says the refusal lasts only while the level is up.
- **Nothing is changed silently.** Every change is listed in the ``X-Brownout-Shaped`` response
  header, ``field=before->after`` joined by ``", "`` (``max_tokens=512->64, min_tokens=100->64``,
  ``stream_interval=1->8``);
  a refusal carries ``field=refused``. An unshaped request has no header.

Wiring (the ingress), after the request is validated (limits, ``max_tokens_limit``) and before
admission and any enrichment, so a refusal costs no capacity::

    plan = ShapingPlan.from_config(policy)           # at every policy load / reconfigure()
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    fields = {n: getattr(body, n, None) for n in REQUEST_FIELDS if n not in TOKEN_CAP_FIELDS}
    fields[field] = effective_max_tokens   # the client's value or the default, under its name
    fields[STREAM_FIELD] = engine_interval if body.stream else None
    shaped = shape(plan, view.level, fields)
    if shaped.refusal:                                # 400, OpenAI error JSON, param = field
        r = shaped.refusal; answer r.status, r.message, r.field, r.code + SHAPED_HEADER
    sampling = shaped.apply_to(sampling)              # max_tokens / min_tokens lowered
    model_request["stream_interval"] = shaped.stream_interval   # None: the engine's own
    if shaped.header: response.headers[SHAPED_HEADER] = shaped.header   # streamed too
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from policies.config import LEVEL_KEYS, REFUSABLE, DegradationConfig

SHAPED_HEADER = "X-Brownout-Shaped"
REFUSAL_STATUS = 400
REFUSAL_CODE = "not_served_at_level"

# The request fields that carry the output-token cap; the first is the engine's key.
TOKEN_CAP_FIELDS: tuple[str, ...] = ("max_tokens", "max_completion_tokens")
# The tokens a streamed request gets per increment: not a client's field; the ingress passes the
# engine's ``model.stream_interval`` under it for a streamed request (None: not streamed).
STREAM_FIELD = "stream_interval"


def _more_than_one(value: Any) -> bool:
    return value not in (None, 1)


def _truthy(value: Any) -> bool:  # logprobs: true (chat) or k > 0 (completions); False/0 ask nothing
    return value not in (None, False)


def _positive(value: Any) -> bool:
    return value not in (None, 0)


def _present(value: Any) -> bool:
    return value is not None


# Refusable name (`policies.config.REFUSABLE`) -> the request fields that ask for it: (field,
# does this value ask for it, what to send instead).
REFUSED_FIELDS: Mapping[str, tuple[tuple[str, Callable[[Any], bool], str], ...]] = {
    "n": (("n", _more_than_one, "n=1"),),
    "best_of": (("best_of", _more_than_one, "best_of=1"),),
    "logprobs": (
        ("logprobs", _truthy, "no logprobs"),
        ("top_logprobs", _positive, "no top_logprobs"),
    ),
    "prompt_logprobs": (("prompt_logprobs", _present, "no prompt_logprobs"),),
}
assert tuple(REFUSED_FIELDS) == REFUSABLE, "config and shaping must agree"

# Every request field `shape` reads; the ingress passes these (others are ignored).
REQUEST_FIELDS: tuple[str, ...] = (
    *TOKEN_CAP_FIELDS,
    "min_tokens",
    *(field for checks in REFUSED_FIELDS.values() for field, _, _ in checks),
)


@dataclass(frozen=True, slots=True)
class Change:
    """One field lowered by shaping; ``str()`` is its header item, ``max_tokens=512->64``."""

    field: str
    before: int
    after: int

    def __str__(self) -> str:
        return f"{self.field}={self.before}->{self.after}"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request asking for a field its level does not serve: answer ``status`` (400)."""

    field: str  # the request field, OpenAI's ``param``
    value: Any
    level: int
    message: str
    status: int = REFUSAL_STATUS
    code: str = REFUSAL_CODE


@dataclass(frozen=True, slots=True)
class Shaped:
    """What shaping did to one request: fields lowered, or a refusal; nothing when neither."""

    changes: tuple[Change, ...] = ()
    refusal: Refusal | None = None

    @property
    def header(self) -> str | None:
        """The ``X-Brownout-Shaped`` value; None when the request is untouched (no header)."""
        if self.refusal is not None:
            return f"{self.refusal.field}=refused"
        if not self.changes:
            return None
        return ", ".join(str(c) for c in self.changes)

    @property
    def updates(self) -> dict[str, int]:
        """The changed fields under the request's names: ``{"max_tokens": 64}``."""
        return {c.field: c.after for c in self.changes}

    @property
    def stream_interval(self) -> int | None:
        """The tokens per increment to stream in; None: unchanged (the engine's own)."""
        return next((c.after for c in self.changes if c.field == STREAM_FIELD), None)

    def apply_to(self, sampling: Mapping[str, Any]) -> dict[str, Any]:
        """``sampling`` (the engine's keys) with the lowered values; a cap on
        ``max_completion_tokens`` lands on the engine's ``max_tokens``. The stream's increments
        are not a sampling setting (they change how the answer travels, not the answer):
        `stream_interval`."""
        out = dict(sampling)
        for c in self.changes:
            if c.field != STREAM_FIELD:
                out["max_tokens" if c.field in TOKEN_CAP_FIELDS else c.field] = c.after
        return out


UNSHAPED = Shaped()


@dataclass(frozen=True, slots=True)
class LevelShape:
    """What one level shapes, inheritance already applied."""

    max_tokens: int | None = None
    refuse: tuple[str, ...] = ()  # refusable names, `REFUSABLE` order
    # (field, asks-for-it test, what to send instead), flattened from REFUSED_FIELDS
    checks: tuple[tuple[str, Callable[[Any], bool], str], ...] = ()
    stream_interval: int | None = None

    @property
    def active(self) -> bool:
        return self.max_tokens is not None or bool(self.refuse) or self.stream_interval is not None


@dataclass(frozen=True, slots=True)
class ShapingPlan:
    """Per level 0..3, the shaping in force; build it once per policy load."""

    levels: tuple[LevelShape, ...] = (LevelShape(),) * (len(LEVEL_KEYS) + 1)

    @classmethod
    def from_config(cls, config: DegradationConfig) -> ShapingPlan:
        levels = []
        for level in range(len(LEVEL_KEYS) + 1):
            eff = config.shape_at(level)
            refuse = tuple(eff.refuse)
            checks = tuple(check for name in refuse for check in REFUSED_FIELDS[name])
            levels.append(LevelShape(eff.max_tokens, refuse, checks, eff.stream_interval))
        return cls(tuple(levels))

    def at(self, level: int) -> LevelShape:
        """The shaping at ``level``; below 0 reads as 0, above the top as the top level."""
        return self.levels[min(max(int(level), 0), len(self.levels) - 1)]


NO_SHAPING = ShapingPlan()


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def shape(plan: ShapingPlan, level: int, fields: Mapping[str, Any]) -> Shaped:
    """Shape one request at ``level`` (the ingress's current level).

    ``fields``: the request's values of `REQUEST_FIELDS` (missing or None: not asked for), with
    the output-token cap the request would get unshaped (the client's value or the server's
    default) under the name the client used, and, for a streamed request only, its increments
    unshaped under `STREAM_FIELD`. Returns `UNSHAPED` when nothing applies, a `Shaped` with a
    `Refusal` when the request asks for a field refused at this level (the first such field, in
    `REFUSABLE` order), otherwise a `Shaped` listing each field changed: every token-cap field
    above the level's cap, ``min_tokens`` above it, and the increments where the level's are
    larger.
    """
    at = plan.at(level)
    if not at.active:
        return UNSHAPED
    for field, asks, instead in at.checks:
        value = fields.get(field)
        if value is not None and asks(value):
            lv = int(level)
            message = (
                f"{field}={_show(value)} is not served at brownout level {lv} (the service is "
                f"shedding load); send the request with {instead} to be served now, or send it "
                "again once the load has fallen"
            )
            return Shaped(refusal=Refusal(field, value, lv, message))
    changes = []
    cap = at.max_tokens
    if cap is not None:
        for field in (*TOKEN_CAP_FIELDS, "min_tokens"):
            value = fields.get(field)
            if value is not None and value > cap:
                changes.append(Change(field, value, cap))
    interval, unshaped = at.stream_interval, fields.get(STREAM_FIELD)
    if interval is not None and unshaped is not None and interval > unshaped:
        changes.append(Change(STREAM_FIELD, unshaped, interval))
    return Shaped(tuple(changes)) if changes else UNSHAPED


__all__ = [
    "Change",
    "LevelShape",
    "NO_SHAPING",
    "REFUSAL_CODE",
    "REFUSAL_STATUS",
    "REFUSED_FIELDS",
    "REQUEST_FIELDS",
    "Refusal",
    "SHAPED_HEADER",
    "STREAM_FIELD",
    "Shaped",
    "ShapingPlan",
    "TOKEN_CAP_FIELDS",
    "UNSHAPED",
    "shape",
]
