"""An optional feature's implementation: where it runs, its settings, its payload, its effect.

`policies.features.REGISTRY` holds one line per feature (name, stage, supported off-modes, and
``impl``, the ``module:attribute`` of a `Feature`). The `Feature` owns everything else, so the
pipeline walks the registry and never names a feature:

- ``worker``: the plain `Enrichment` object that does the work, and *where it runs*
  (``Worker.host``): ``None`` runs it inside the ingress process, for pure cheap logic (no RPC);
  a deployment name puts it in its own Serve deployment, for state or heavy compute (an
  embedding model, SQLite, fsync'd files). Several features may share one worker (the semantic
  cache serves lookup and write), and so one instance and one deployment.
- ``Worker.settings``: the typed (pydantic) settings of the worker, from the builder args'
  ``enrichments.settings.<kind>``; ``Worker.state_paths`` names the settings that default to a
  path under ``enrichments.data_dir``.
- ``payload(request)``: what a pre or post stage sends, built from the `RequestState`. A side
  effect always receives ``{"records": [record, ...]}`` (see `RequestState.record`), so deferred
  records can be delivered in batches.
- ``apply(request, result)``: how a pre or post stage's result changes the request; results are
  applied in registry order, so concurrent calls give the same outcome as sequential ones.
- ``on_bypass(request, settings)``: what not running it means for this request (disabled by the level,
  failed or timed out); e.g. the A/B feature tags the request ``excluded``.
- ``wants(request)``: whether a side effect takes this request's record at all (the cache write
  takes only answers the client's own text alone shaped).
- ``audits_failures``: whether a side effect also takes the record of a request that did not end
  in a whole answer (``outcome`` ``failed``, ``client_dropped``, ``refused``); only the audit
  log does: a cache write or a usage statistic of a failure would be wrong.

Every record a side effect receives has a ``record_id`` (`record_id`: the request's own id and
the feature): the same request audited twice (a retried batch, a spool redelivery) has one id,
so the sink can drop the copy.

A feature's off-modes are declared in the registry line; a ``default``-mode feature's configured
default is passed to ``apply`` as if the stage had returned it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from deployments.enrichments.base import Enrichment
from policies.features import REGISTRY, FeatureSpec, PolicyView, Stage

# Names the side effects deferred to a durable spool (a header, or for a stream an SSE comment
# line before [DONE]); only ever once the record is on disk (serve_app.pipeline.settle).
DEFERRED_HEADER = "X-Brownout-Deferred"


ANONYMOUS = "anonymous"  # the tenant of every request when API keys are disabled by config


@dataclass
class RequestState:
    """One request's way through the pipeline, as features read and change it."""

    request_id: str
    user: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | None
    sampling: dict[str, Any]
    explicit: frozenset[str]  # sampling keys the client set itself: features never override them
    view: PolicyView
    key_text: str = ""  # the client's own text, before any feature changed it
    text: str = ""  # the answer, once there is one (post stages change it)
    answer: str | None = None  # set by a pre stage that answers the request itself: no model call
    # with ``answer``: its honest usage (prompt tokens, completion tokens) and finish reason
    answer_usage: tuple[int, int] = (0, 0)
    answer_finish: str = "stop"
    tenant: str = "anonymous"  # who the request's API key belongs to (ANONYMOUS without keys): scopes shared state
    client_request_id: str | None = None  # the client's X-Request-ID: echoed and logged, never the engine's id
    model: str = ""  # the served model's name: scopes anything shared (the semantic cache)
    personal: bool = False  # a feature shaped the prompt for this user: the answer is theirs alone
    tags: dict[str, Any] = field(default_factory=dict)  # feature annotations, copied into the record
    headers_out: dict[str, str] = field(default_factory=dict)  # feature response headers
    # a stream's tokens per increment, set by the level's shaping (None: the engine's own); not a
    # sampling setting: it changes how the answer travels, not the answer
    stream_interval: int | None = None
    bypassed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  # only once durable: X-Brownout-Deferred names them
    planned: list[str] = field(default_factory=list)  # side effects the level defers (not yet durable)
    outcome: str = "ok"  # ok | failed | client_dropped | refused: what the record says happened
    status: int | None = None  # the HTTP status of a refused or failed request
    side_decided: bool = False  # which side effects the level skips or defers is decided (once)
    settled: bool = False  # side effects taken: a request's record is handed on exactly once
    started: float = field(default_factory=time.monotonic)

    def payload(self) -> dict[str, Any]:
        """The client's request as pre stages usually want it."""
        body: dict[str, Any] = {"request_id": self.request_id, "user": self.user}
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        return body

    def headers(self) -> dict[str, str]:
        return {
            "X-Brownout-Level": str(int(self.view.level)),
            "X-Brownout-Bypassed": ",".join(self.bypassed + [f for f in self.failed if f not in self.bypassed]),
            **({DEFERRED_HEADER: ",".join(self.deferred)} if self.deferred else {}),
            **self.headers_out,
        }

    def fill_sampling(self, sampling: Mapping[str, Any] | None) -> None:
        """Set sampling keys the client did not set itself."""
        for key, value in (sampling or {}).items():
            if key not in self.explicit:
                self.sampling[key] = value

    def add_system(self, text: str, prepend: bool) -> None:
        """Put ``text`` into the system message (made if missing), before or after its text."""
        if not text:
            return
        if self.messages is None:
            self.prompt = f"{text}\n{self.prompt}" if prepend else f"{self.prompt}\n{text}"
            return
        if self.messages and self.messages[0]["role"] == "system":
            old = self.messages[0]["content"]
            merged = f"{text}\n{old}" if prepend else f"{old}\n{text}"
            self.messages = [{"role": "system", "content": merged}, *self.messages[1:]]
        else:
            self.messages = [{"role": "system", "content": text}, *self.messages]

    def record(self, finish: str | None, usage: Mapping[str, int]) -> dict[str, Any]:
        """The finished request, as side effects receive it (JSON-able)."""
        return {
            "request_id": self.request_id, "client_request_id": self.client_request_id, "tenant": self.tenant,
            "at": time.time(), "user": self.user, "key_text": self.key_text,
            "prompt": self.prompt if self.messages is None else self.messages,
            "sampling": self.sampling, "response": {"text": self.text, "finish_reason": finish},
            "usage": dict(usage), "latency_ms": (time.monotonic() - self.started) * 1000.0,
            "level": int(self.view.level), "answered": self.answer is not None,
            "bypassed": list(self.bypassed), "outcome": self.outcome,
            **({"status": self.status} if self.status is not None else {}), **self.tags,
        }


OUTCOMES = ("ok", "failed", "client_dropped", "refused")


def record_id(request_id: str, feature: str) -> str:
    """The id a side effect's record carries: unique per request and feature, stable across retries."""
    return f"{request_id}:{feature}"


def _nothing(request: RequestState, *args: Any) -> None:
    return None


def _everything(request: RequestState) -> bool:
    return True


class _NoSettings(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}


@dataclass(frozen=True)
class Worker:
    """The plain object behind one or more features, and where it runs (see the module doc)."""

    kind: str
    cls: type[Enrichment]
    host: str | None
    settings: type[BaseModel] = _NoSettings
    state_paths: Mapping[str, str] = field(default_factory=dict)

    def resolve(self, raw: Mapping[str, Any], data_dir: Path) -> dict[str, Any]:
        """Validated settings as plain values, state paths defaulted under ``data_dir``.

        ValueError names the kind, the key and the bad value.
        """
        values = {k: str(Path(data_dir).expanduser() / sub) for k, sub in self.state_paths.items()}
        values.update(raw)
        return self._validate(values).model_dump(mode="json", exclude_unset=True)

    def build(self, settings: Mapping[str, Any]) -> Enrichment:
        """Construct the worker from settings (see `resolve`); ValueError as there."""
        return self.cls(**self._validate(dict(settings)).model_dump(exclude_unset=True))

    def _validate(self, values: Mapping[str, Any]) -> BaseModel:
        try:
            return self.settings.model_validate(values)
        except ValidationError as err:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                + (f" (got {e['input']!r})" if e["type"] not in ("missing", "value_error") else "")
                for e in err.errors()
            )
            raise ValueError(f"enrichments.settings.{self.kind}: {problems}") from None


@dataclass(frozen=True)
class Feature:
    """One optional feature's implementation; see the module docstring for each field."""

    name: str
    worker: Worker
    payload: Callable[[RequestState], dict[str, Any]] = RequestState.payload
    apply: Callable[[RequestState, Mapping[str, Any]], None] = _nothing
    on_bypass: Callable[[RequestState, Mapping[str, Any]], None] = _nothing  # (request, worker settings)
    wants: Callable[[RequestState], bool] = _everything
    audits_failures: bool = False  # a side effect that also takes failed, dropped and refused requests

    @property
    def spec(self) -> FeatureSpec:
        return REGISTRY[self.name]

    @property
    def stage(self) -> Stage:
        return self.spec.stage

    @property
    def host(self) -> str | None:
        return self.worker.host
