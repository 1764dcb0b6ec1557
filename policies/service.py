"""PolicyCore: the policy actor's whole behaviour, without Ray, testable with a fake clock.

It holds the config, the signal aggregator and the controller state; `tick()` runs `decide()`.
Persistence (config + operator overrides + level) goes through injected ``persist``/``restore``
callables so that a restarted actor comes back with the same policy and pins; signals and dwell
timers are not persisted: they rebuild from fresh reports, and until then the restored level
holds (fail-static).

Operators' accounting lives here too, so that it is pure and testable: `threshold_table` (each
level's trigger and recover value per signal, what "signals against thresholds" compares with)
and `FeatureClock` (per optional feature: seconds disabled and how often it was turned off, by
cause, since the actor started and over the last ``window_s``). The actor turns both into
Prometheus metrics; ``get_state()`` (``GET /admin/brownout``) carries them as ``thresholds`` and
``feature_time``.

The model's outages (`record_outage`, `model_outages`): how long each lasted, as the ingress
replicas saw them end (`serve_app.health.ModelHealth`), kept here so that every ingress replica,
one started after the outage or restarted since, predicts the next from the same record (its
``Retry-After`` while the model is down). Replicas see one outage end within a probe or two of
each other: reports whose ends lie within `OUTAGE_SAME_S` are one outage, kept at the longest
(the replica that saw it begin first saw most of it). The last `OUTAGES_KEPT` are kept and
persisted with the policy.
"""

from __future__ import annotations

import collections
import hashlib
import math
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from policies.config import DegradationConfig, PolicyError, parse_policy
from policies.controller import (
    ControllerState,
    LevelPin,
    Transition,
    clear_feature,
    decide,
    enabled_features,
    force_feature,
    pin_level,
    unpin,
)
from policies import features as feat
from policies.autoscale import PolicyLoad
from policies.features import REGISTRY, FeatureOverride, Level, OffMode, PolicyView
from policies.signals import Aggregator, Report, Signals
from policies.slo import fit_policy

logger = logging.getLogger("brownout.policy")

LEVELS = (1, 2, 3)
OUTAGES_KEPT = 5  # the model outages kept, whose median predicts the next (`ModelHealth`)
# two ingress replicas' reports of outages that ended this close together are one outage: each
# replica sees the end at its next probe answer (every 0.5 s) or served request, and a model
# replica comes back no sooner than a new one starts (tens of seconds on a GPU, minutes on CPU)
OUTAGE_SAME_S = 10.0


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def threshold_table(config: DegradationConfig) -> dict[str, dict[str, dict[str, float]]]:
    """``{signal: {"1": {"trigger": t, "recover": r}, ...}}`` for every signal a level triggers on.

    Level keys are strings (the table travels as JSON). The recover value is the one `decide`
    uses (defaults filled in: ``recover_ratio`` of the trigger).
    """
    out: dict[str, dict[str, dict[str, float]]] = {}
    for level in LEVELS:
        recover = config.recover_thresholds(level)
        for signal, trigger in config.trigger_thresholds(level).items():
            out.setdefault(signal, {})[str(level)] = {"trigger": float(trigger), "recover": float(recover[signal])}
    return out


def off_causes(enabled: frozenset[str], by_level: frozenset[str]) -> dict[str, str]:
    """Why each optional feature that does not run now is off: ``level`` (the level's rule
    turns it off) or ``override`` (an operator forced it off while the level allows it)."""
    return {f: ("override" if f in by_level else "level") for f in feat.optional_names() if f not in enabled}


class FeatureClock:
    """Per optional feature: seconds spent disabled and how often it was turned off, by cause,
    since start and over the last ``window_s`` (5 minutes).

    ``update(now, off)`` is called on every policy tick and right after every operator change
    (`PolicyCore._account`) with the features that are off now and why (`off_causes`); the time
    since the previous update is charged to every feature off at both ends (a tick is 250 ms, so
    a level's edge is placed within one tick, an operator's exactly). A turn-off is counted on
    an observed on -> off edge only: the first update, when the core is built (after a restore),
    establishes the state (after an actor restart at level 3, nothing was "turned off" by the
    new actor). Returns this update's
    increments, ``(seconds disabled per feature, [(feature, cause) turned off])``, which the
    actor adds to its counters.
    """

    def __init__(self, window_s: float = 300.0, max_intervals: int = 4096) -> None:
        self.window_s = window_s
        self.max_intervals = max_intervals
        self._last: float | None = None
        self._off: dict[str, str] = {}
        self.disabled_s: collections.Counter[str] = collections.Counter()
        self.turned_off: collections.Counter[tuple[str, str]] = collections.Counter()
        # recent history for the window: (start, end) disabled and the times of turn-offs
        self._intervals: dict[str, collections.deque[tuple[float, float]]] = {}
        self._edges: dict[str, collections.deque[tuple[float, str]]] = {}

    def update(self, now: float, off: Mapping[str, str]) -> tuple[dict[str, float], list[tuple[str, str]]]:
        added: dict[str, float] = {}
        edges: list[tuple[str, str]] = []
        if self._last is not None:
            dt = max(0.0, now - self._last)
            for feature in off:
                if feature in self._off:
                    if dt > 0:
                        added[feature] = dt
                        self.disabled_s[feature] += dt
                        self._interval(feature, self._last, now)
                else:
                    cause = off[feature]
                    edges.append((feature, cause))
                    self.turned_off[(feature, cause)] += 1
                    self._edges.setdefault(feature, collections.deque(maxlen=self.max_intervals)).append((now, cause))
        self._last = now
        self._off = dict(off)
        self._trim(now)
        return added, edges

    def _interval(self, feature: str, start: float, end: float) -> None:
        spans = self._intervals.setdefault(feature, collections.deque(maxlen=self.max_intervals))
        if spans and spans[-1][1] == start:  # extend the running span instead of adding ticks
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for spans in self._intervals.values():
            while spans and spans[0][1] <= cutoff:
                spans.popleft()
        for edges in self._edges.values():
            while edges and edges[0][0] < cutoff:
                edges.popleft()

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        """Per optional feature: ``off`` now (and its cause), ``disabled_s`` and ``turned_off``
        (by cause) since start, and the same over the last ``window_s`` (``*_window``)."""
        cutoff = now - self.window_s
        out: dict[str, dict[str, Any]] = {}
        for feature in feat.optional_names():
            spans = self._intervals.get(feature, ())
            recent = sum(max(0.0, min(end, now) - max(start, cutoff)) for start, end in spans)
            edges = [cause for at, cause in self._edges.get(feature, ()) if at >= cutoff]
            out[feature] = {
                "off": feature in self._off,
                "cause": self._off.get(feature),
                "disabled_s": round(self.disabled_s[feature], 3),
                "turned_off": {c: n for (f, c), n in sorted(self.turned_off.items()) if f == feature},
                "disabled_s_window": round(recent, 3),
                "turned_off_window": dict(collections.Counter(edges)),
            }
        return out


def policy_view(config: DegradationConfig, level: int, enabled: frozenset[str], version: int = 0,
                at: float = 0.0, replicas: Mapping[str, int] | None = None) -> PolicyView:
    """The view of ``config`` at ``level`` with ``enabled`` running: off-modes and defaults
    from the config."""
    features = config.features
    return PolicyView(
        level=level, enabled=enabled,
        modes={f: config.off_mode(f) for f in features if config.off_mode(f) is not OffMode.SKIP},
        defaults={f: config.off_default(f) for f in features if config.off_mode(f) is OffMode.DEFAULT},
        config_version=version, at=at, replicas=replicas,
    )


def start_view(config: DegradationConfig | None, level: int) -> PolicyView:
    """What a replica serves before it has heard from the policy actor: ``config``'s rule at
    ``level`` with no override (config_version 0, so the first view from the actor replaces it).
    With no config yet, a level above 0 runs the critical features only: without the policy, the
    most degraded state is the one that turns every optional feature off."""
    if config is None:
        enabled = frozenset(REGISTRY) if level == 0 else frozenset(n for n, s in REGISTRY.items() if s.critical)
        return PolicyView(level=level, enabled=enabled)
    return policy_view(config, level, feat.enabled_set(level, config.off_levels(), {}))


class PolicyCore:
    """Everything the actor does, minus Ray: testable with a fake clock and a dict store."""

    def __init__(
        self,
        config: DegradationConfig,
        clock: Callable[[], float] = time.time,
        history_size: int = 1000,
        persist: Callable[[bytes], None] | None = None,
        restore: Callable[[], bytes | None] | None = None,
        on_transition: Callable[[Transition], None] | None = None,
    ) -> None:
        self.clock = clock
        self.config = config
        self.state = ControllerState()
        self.aggregator = Aggregator(config.stale_after_s, config.forget_s)
        self.signals = Signals(at=clock())
        self.transitions: collections.deque[dict[str, Any]] = collections.deque(maxlen=history_size)
        self.report_errors = 0
        self.reports = 0
        self.failed_reads = 0  # reports that carried a signal its replica failed to read
        self.config_version = 1
        self.last_config_error: str | None = None
        # The engine's batch size, as the ingress last said (`update_config`): a policy with an
        # `slo` section has its level triggers derived for it (`policies.slo`).
        self.batch_slots: int | None = None
        # Which copy of the policy wins (`update_config`): the digest of the last deployed
        # document, and where the running policy came from.
        self.deployed_digest: str | None = None
        self.config_origin = "default"
        self._persist = persist
        self._on_transition = on_transition
        # operators' accounting (see the module docstring): updated on every tick and at once on
        # every operator change; increments wait in `_pending` until the actor's metrics take them
        self.feature_clock = FeatureClock()
        self._pending_s: collections.Counter[str] = collections.Counter()
        self._pending_edges: list[tuple[str, str]] = []
        self.outages: list[tuple[float, float]] = []  # (ended_at, duration_s), oldest first
        if restore is not None:
            self._restore(restore)
        # The clock's starting state is the restored one: whatever is off now was not "turned
        # off" by this actor, and an override set before the first tick is an edge.
        self._account(self.clock())
        # Readers follow the view by long-poll (`view_seq`, `publish`): the sequence number moves
        # whenever what a reader acts on (level, features, policy version) changes.
        self.view_seq = 0
        self._view_key: tuple[object, ...] | None = None
        self._floor_key: tuple[int, int] | None = None
        self._floor: dict[str, float] = {}
        self.publish()

    # -- persistence ---------------------------------------------------------------------------

    def _snapshot(self) -> bytes:
        pin = self.state.pin
        return json.dumps({
            "config": self.config.model_dump(mode="json"),
            "config_version": self.config_version,
            "batch_slots": self.batch_slots,
            "deployed_digest": self.deployed_digest,
            "config_origin": self.config_origin,
            "level": int(self.state.policy_level),
            "pin": None if pin is None else {"level": int(pin.level), "expires_at": pin.expires_at, "note": pin.note},
            "features": [{"feature": o.feature, "enabled": o.enabled, "expires_at": o.expires_at}
                         for o in self.state.feature_overrides.values()],
            "outages": [[ended_at, duration_s] for ended_at, duration_s in self.outages],
        }).encode()

    def _save(self) -> None:
        if self._persist is None:
            return
        try:
            self._persist(self._snapshot())
        except Exception:  # noqa: BLE001 - persistence is best effort; the live state is right
            logger.exception("could not persist policy state")

    def _restore(self, restore: Callable[[], bytes | None]) -> None:
        try:
            raw = restore()
            if not raw:
                return
            doc = json.loads(raw)
            self.config = parse_policy(doc["config"])
            self.config_version = doc.get("config_version", 1)
            self.batch_slots = doc.get("batch_slots")
            self.deployed_digest = doc.get("deployed_digest")
            self.config_origin = doc.get("config_origin", "restored")
            pin = doc.get("pin")
            overrides = {f["feature"]: FeatureOverride(f["feature"], f["enabled"], f["expires_at"])
                         for f in doc.get("features", [])}
            self.state = replace(
                self.state,
                # The restored level holds until fresh signals say otherwise: recovery from it
                # needs a full dwell, escalation acts at once.
                policy_level=Level(doc.get("level", 0)),
                last_change_at=self.clock(),
                pin=None if pin is None else LevelPin(Level(pin["level"]), pin["expires_at"], pin.get("note", "")),
                feature_overrides=overrides,
            )
            self.aggregator = Aggregator(self.config.stale_after_s, self.config.forget_s)
            for item in doc.get("outages", []):  # one bad entry loses only itself
                try:
                    self.record_outage(*item, save=False)
                except (TypeError, ValueError) as err:
                    logger.warning("persisted model outage %r dropped: %s", item, err)
            logger.info("policy restored: level %d, pin %s, %d feature overrides",
                        self.state.level, pin, len(overrides))
        except Exception:  # noqa: BLE001 - a corrupt snapshot must not keep the actor down
            logger.exception("could not restore persisted policy state; starting from the default")

    # -- signals and ticks ---------------------------------------------------------------------

    def publish(self) -> bool:
        """Move ``view_seq`` if the view changed since the last call; True if it did.

        Called after every change (tick, operator call, policy update): a reader waiting on
        ``view_seq`` (the actor's ``watch``) is answered at once instead of at its next poll.
        The replicas reporting per deployment are part of the view: a replica that starts or
        stops serving reaches every ingress the same way.
        """
        now = self.clock()
        key = (int(self.state.level), enabled_features(self.config, self.state, now), self.config_version,
               tuple(sorted(self.signals.replicas.items())))
        if key == self._view_key:
            return False
        self._view_key = key
        self.view_seq += 1
        return True

    def escalation_floor(self) -> Mapping[str, float]:
        """Per signal, the lowest trigger of any level above the policy level: a report value at
        or above it may raise the level (`may_escalate`). Computed once per policy level and
        config version; node reporters get it back with every batch, to send such a report at
        once instead of with the next batch."""
        key = (int(self.state.policy_level), self.config_version)
        if key != self._floor_key:
            floor: dict[str, float] = {}
            for lv in range(int(self.state.policy_level) + 1, 4):
                for name, value in self.config.trigger_thresholds(lv).items():
                    floor[name] = min(value, floor.get(name, math.inf))
            self._floor_key, self._floor = key, floor
        return self._floor

    def may_escalate(self, values: Mapping[str, float]) -> bool:
        """Whether one report's values alone reach a trigger of a level above the policy level:
        the actor then decides at once instead of at its next tick. A cheap, partial check (a
        sum over replicas can cross with no one report crossing: the regular tick sees that)."""
        floor = self.escalation_floor()
        return any(name in floor and v >= floor[name] for name, v in values.items())

    def report_many(self, batch: Sequence[tuple[str, Mapping[str, float], Sequence[str]]]) -> int:
        """Several replicas' reports in one call (a node's batch); returns how many were kept."""
        return sum(1 for source, values, stale in batch if self.report(source, values, stale))

    def report(self, source: str, values: Mapping[str, float], stale: Sequence[str] = ()) -> bool:
        """Keep one replica's report; ``stale``: signals it could not read (counted, and stale)."""
        try:
            self.aggregator.add(Report(source, self.clock(), {k: float(v) for k, v in values.items()},
                                       frozenset(stale)))
            self.reports += 1
            if stale:
                self.failed_reads += 1
            return True
        except (ValueError, TypeError):
            self.report_errors += 1
            logger.warning("rejected report from %s: %r", source, dict(values))
            return False

    def tick(self) -> Transition | None:
        now = self.clock()
        self.signals = self.aggregator.aggregate(now)
        before_pin = self.state.pin
        self.state, transition = decide(self.config, self.state, self.signals, now)
        if transition is not None:
            self._record(transition)
        # the policy level is persisted on change (and an expired pin is dropped)
        if transition is not None or before_pin is not self.state.pin:
            self._save()
        self._account(now)
        return transition

    def _account(self, now: float) -> None:
        """Bring the `FeatureClock` up to ``now`` and keep its increments for `take_accounting`.

        Called on every tick and right after every operator change (a pin, a feature override
        set or cleared). Without the latter, an override's turn-off was an edge only if a tick ran
        while it alone was in force: an override followed within a tick by a level pin that
        turns the same feature off was counted as the level's (or not at all, if the clock first
        saw the feature off), and the next tick's increments replaced those the metrics had not
        taken yet.
        """
        added, edges = self.feature_clock.update(now, self.off_now(now))
        self._pending_s.update(added)
        self._pending_edges.extend(edges)

    def take_accounting(self) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """The increments since the last call: ``(seconds disabled per feature, [(feature,
        cause) turned off])``; the actor adds them to its counters."""
        added, edges = dict(self._pending_s), list(self._pending_edges)
        self._pending_s.clear()
        self._pending_edges.clear()
        return added, edges

    def off_now(self, now: float) -> dict[str, str]:
        """The optional features off now, and why (`off_causes`)."""
        return off_causes(enabled_features(self.config, self.state, now),
                          feat.enabled_set(self.state.level, self.config.off_levels(), {}))

    def _record(self, transition: Transition) -> None:
        self.transitions.append(transition.to_dict())
        logger.warning(transition.to_json())
        if self._on_transition is not None:
            self._on_transition(transition)

    # -- operators -----------------------------------------------------------------------------

    def set_override(self, *, level: int | None = None, feature: str | None = None,
                     enabled: bool | None = None, ttl_s: float | None = None, note: str = "") -> dict[str, Any]:
        """Pin a level, or force one feature on/off; ``ttl_s`` None means until cleared."""
        now = self.clock()
        try:
            if ttl_s is not None and not (0 < ttl_s < math.inf):
                raise ValueError(f"ttl_s: {ttl_s!r} must be a finite number of seconds > 0 (or None: until cleared)")
            if (level is None) == (feature is None):
                raise ValueError("give exactly one of 'level' or 'feature'")
            if level is not None:
                self.state, transition = pin_level(self.state, level, now, ttl_s, note, self.signals)
                if transition is not None:
                    self._record(transition)
            else:
                if enabled is None:
                    raise ValueError("a feature override needs 'enabled': true or false")
                self.state = force_feature(self.state, feature, enabled, now, ttl_s)  # type: ignore[arg-type]
        except ValueError as err:
            return {"ok": False, "error": str(err)}
        self._account(now)
        self._save()
        logger.warning(json.dumps({"event": "brownout_override_set", "at": now, "level": level,
                                   "feature": feature, "enabled": enabled, "ttl_s": ttl_s, "note": note}))
        return {"ok": True, "state": self.get_state()}

    def clear_override(self, *, level: bool = False, feature: str | None = None) -> dict[str, Any]:
        now = self.clock()
        if level:
            self.state, transition = unpin(self.state, now, self.signals)
            if transition is not None:
                self._record(transition)
        if feature is not None:
            self.state = clear_feature(self.state, feature)
        self._account(now)
        self._save()
        logger.warning(json.dumps({"event": "brownout_override_cleared", "at": now, "level": level, "feature": feature}))
        return {"ok": True, "state": self.get_state()}

    def update_config(self, document: Mapping[str, Any], batch_slots: int | None = None,
                      origin: str = "operator") -> dict[str, Any]:
        """Validate and swap the policy. A rejected config leaves the running one in force.

        The actor holds the one policy every reader follows: the ingress replicas read the
        level from its view and, when its ``config_version`` moves, the policy itself (for
        admission and shaping). ``batch_slots``: the engine's batch size (the ingress sends it;
        other callers may leave it out and the last one given is used): queue triggers are
        checked against it and a policy with an ``slo`` section gets the level triggers it does
        not write itself derived for it (`policies.slo.fit_policy`).

        Which copy wins (``origin``): the last *change* wins. An operator's call
        (``origin="operator"``, the default) always applies. A deployed document
        (``origin="deploy"``: the ingress's ``reconfigure`` with the ``user_config`` of
        ``serve deploy``) applies only when it differs from the last deployed document: Serve
        calls ``reconfigure`` again on every replica start, scale-up or redeploy of unchanged
        config, and that must not undo an operator's change. The last deployed document's
        digest is persisted with the policy, so an actor restart changes none of this.
        """
        if origin not in ("operator", "deploy"):
            return {"ok": False, "error": f"origin: {origin!r} is not 'operator' or 'deploy'",
                    "config_version": self.config_version}
        if batch_slots is not None:
            self.batch_slots = int(batch_slots)
        digest = None
        if origin == "deploy":
            digest = hashlib.sha256(json.dumps([document, self.batch_slots], sort_keys=True,
                                               default=str).encode()).hexdigest()
            if digest == self.deployed_digest:
                return {"ok": True, "changed": False, "config_version": self.config_version,
                        "kept": "the running policy: this deployed document was applied before"}
        try:
            config = parse_policy(document)
            if self.batch_slots is not None:
                config = fit_policy(config, self.batch_slots)
        except PolicyError as err:
            self.last_config_error = str(err)
            logger.error(json.dumps({"event": "brownout_config_rejected", "origin": origin, "error": str(err)}))
            return {"ok": False, "error": str(err), "config_version": self.config_version}
        self.last_config_error = None
        if digest is not None:
            self.deployed_digest = digest
        if config == self.config:
            self._save()
            return {"ok": True, "changed": False, "config_version": self.config_version}
        self.config = config
        self.config_version += 1
        self.config_origin = origin
        self.aggregator.stale_after_s = config.stale_after_s
        self.aggregator.forget_after_s = config.forget_s
        self._save()
        logger.warning(json.dumps({"event": "brownout_config_applied", "origin": origin,
                                   "config_version": self.config_version}))
        return {"ok": True, "changed": True, "config_version": self.config_version}

    # -- the model's outages -------------------------------------------------------------------

    def record_outage(self, ended_at: float, duration_s: float, save: bool = True) -> list[float]:
        """An ingress replica saw the model down for ``duration_s`` until ``ended_at`` (wall
        seconds). One that ended within `OUTAGE_SAME_S` of an outage already kept is that outage
        (kept at the longer duration). Returns `model_outages`. A value that is not a finite
        number (``duration_s`` also >= 0) raises ValueError naming it, and nothing is kept."""
        for name, value in (("ended_at", ended_at), ("duration_s", duration_s)):
            if not finite_number(value) or (name == "duration_s" and value < 0):
                raise ValueError(f"record_outage: {name}={value!r} is not a finite number"
                                 + (" >= 0" if name == "duration_s" else ""))
        ended_at, duration_s = float(ended_at), float(duration_s)
        same = [i for i, (end, _) in enumerate(self.outages) if abs(end - ended_at) <= OUTAGE_SAME_S]
        if same:
            end, kept = self.outages[same[0]]
            self.outages[same[0]] = (end, max(kept, duration_s))
        else:
            self.outages = sorted([*self.outages, (ended_at, duration_s)])[-OUTAGES_KEPT:]
        if save:
            self._save()
        return self.model_outages()

    def model_outages(self) -> list[float]:
        """The durations of the last `OUTAGES_KEPT` outages of the model, oldest first."""
        return [duration_s for _, duration_s in self.outages]

    # -- readers -------------------------------------------------------------------------------

    def view(self) -> PolicyView:
        """What request paths need, small and typed: level, enabled features, off-modes, defaults."""
        now = self.clock()
        return policy_view(self.config, self.state.level, enabled_features(self.config, self.state, now),
                           self.config_version, now, self.signals.replicas)

    def load(self) -> PolicyLoad:
        """What the model's autoscaling policy reads (`policies.autoscale`): the level in force and
        the aggregated ``refused_ratio`` of the last tick (0 where no ingress reports one)."""
        return PolicyLoad(int(self.state.level), float(self.signals.values.get("refused_ratio", 0.0)))

    def get_state(self) -> dict[str, Any]:
        now = self.clock()
        st = self.state
        pin = st.pin
        return {
            **self.view().to_dict(),
            "policy_level": int(st.policy_level),
            "pin": None if pin is None else {"level": int(pin.level), "expires_at": pin.expires_at, "note": pin.note},
            "feature_overrides": {k: {"enabled": o.enabled, "expires_at": o.expires_at}
                                  for k, o in st.feature_overrides.items() if o.active(now)},
            "signals": self.signals.to_dict(),
            "recovery_blocked_by": sorted(st.recovery_blocked_by),
            "calm_since": st.calm_since,
            "last_change_at": st.last_change_at,
            "sources": self.aggregator.sources(),
            "reports": self.reports,
            "failed_reads": self.failed_reads,
            "report_errors": self.report_errors,
            "last_config_error": self.last_config_error,
            "recent_transitions": list(self.transitions)[-10:],
            "thresholds": threshold_table(self.config),
            "feature_time": self.feature_clock.snapshot(now),
            "model_outages": [{"ended_at": end, "duration_s": round(d, 3)} for end, d in self.outages],
        }

    def history(self, n: int = 100) -> list[dict[str, Any]]:
        return list(self.transitions)[-n:] if n > 0 else []


