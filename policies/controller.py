"""The level decision: ``decide(config, state, signals, now) -> (state, transition | None)``.

Pure: no clock, no I/O, no Ray. The caller passes ``now`` and keeps the returned state.

The rule, and why:

- **Escalate fast.** The target is the highest level whose trigger (ANY signal >= its value) has
  held without a break for that level's ``escalate_after_s``; several levels at once if needed.
  No cooldown delays escalation: shedding late is what lets an overload avalanche.
- **Recover slowly, one step at a time.** At level L > 0, step to L-1 only when EVERY signal of
  level L has stayed strictly below its recover value for ``recover_dwell_s`` without a break,
  and at least ``cooldown_s`` after the last level change. Any crossing (a value back at or above
  its recover value) restarts the dwell, and each step down starts a new one: each step has its
  own full dwell, so features come back level by level and the load they add is seen before the next.
  Between recover and trigger lies the dead band, where the level simply holds: a load
  oscillating around one threshold cannot flap.
- **Damp flapping.** Hysteresis stops flapping around one threshold, not periodic bursts whose
  quiet gaps outlast the dwell: each gap earns a step down that the next burst undoes. So a
  re-escalation within ``flap_damping.window_s`` of a step down counts as a *flap*, and the
  recovery dwell becomes ``recover_dwell_s * min(dwell_factor ** flaps, max_dwell_factor)``
  (defaults: doubling, up to 8x). ``reset_after_s`` with no escalation at all forgets the flaps.
  Damping only ever delays a step down: the level is never below what the undamped rule gives,
  and escalation is untouched. The defaults: a 120 s window catches bursts up to four of the
  shipped policy's 30 s dwells apart (two of the 60 s that a level setting none gets); 8x caps
  the longest dwell at 4 minutes there, so one real recovery is not held off for long; ten calm
  minutes mean the bursts are over.
- **Fail static.** A stale signal of level L blocks recovery from L (and restarts the dwell);
  escalation still acts on the fresh values.
- **Operators win.** A level pin sets the effective level until it expires or is cleared. The
  rules keep running underneath on ``policy_level``, so on release the level is what the load
  calls for, not what it was before the pin. Feature overrides force one feature on or off, also
  with an optional expiry; they change which features run, not the level.

Each change of the effective level yields a `Transition`, ready to log as one JSON line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from policies import features as feat
from policies.config import DegradationConfig
from policies.features import FeatureOverride, Level
from policies.signals import Signals

ReasonKind = Literal["trigger", "recover", "override", "override_expired", "override_cleared"]


@dataclass(frozen=True)
class Reason:
    kind: ReasonKind
    signal: str | None = None
    value: float | None = None
    threshold: float | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}


@dataclass(frozen=True)
class Transition:
    at: float
    from_level: Level
    to_level: Level
    reason: Reason
    signals: Signals

    def to_dict(self) -> dict[str, object]:
        return {
            "event": "brownout_level_change",
            "at": self.at,
            "from": int(self.from_level),
            "to": int(self.to_level),
            "reason": self.reason.to_dict(),
            "signals": self.signals.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class LevelPin:
    level: Level
    expires_at: float | None = None
    note: str = ""

    def active(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


@dataclass(frozen=True)
class ControllerState:
    """Everything `decide` remembers between ticks."""

    policy_level: Level = Level.NORMAL  # what the rules say; the effective level unless pinned
    pin: LevelPin | None = None
    feature_overrides: Mapping[str, FeatureOverride] = field(default_factory=dict)
    last_change_at: float | None = None  # last change of policy_level
    # per level 1..3: since when its trigger has held without a break (None: not holding)
    trigger_since: tuple[float | None, float | None, float | None] = (None, None, None)
    calm_since: float | None = None  # since when every signal of policy_level is below recover
    recovery_blocked_by: frozenset[str] = frozenset()  # stale signals holding the level
    # flap damping: recoveries undone by a re-escalation within flap_damping.window_s
    flaps: int = 0
    last_recover_at: float | None = None  # last step down of policy_level
    last_escalate_at: float | None = None  # last step up of policy_level

    @property
    def level(self) -> Level:
        return self.pin.level if self.pin is not None else self.policy_level


# A flap count past this changes nothing (the factor is capped long before); it only bounds ints.
_MAX_FLAPS = 64


def _hottest(thresholds: Mapping[str, float], values: Mapping[str, float]) -> tuple[str, float, float] | None:
    """The signal furthest over (>=) its threshold, as (name, value, threshold), or None."""
    best: tuple[str, float, float] | None = None
    best_ratio = -1.0
    for name, threshold in thresholds.items():
        value = values.get(name)
        if value is None or value < threshold:
            continue
        ratio = value / threshold if threshold > 0 else float("inf")
        if ratio > best_ratio:
            best, best_ratio = (name, value, threshold), ratio
    return best


def _purge(state: ControllerState, now: float) -> tuple[ControllerState, Reason | None]:
    """Drop expired overrides; the reason is set when a pin expired."""
    overrides = {k: o for k, o in state.feature_overrides.items() if o.active(now)}
    reason = None
    pin = state.pin
    if pin is not None and not pin.active(now):
        reason = Reason("override_expired", detail=f"level pin {int(pin.level)} expired")
        pin = None
    if pin is state.pin and len(overrides) == len(state.feature_overrides):
        return state, None
    return replace(state, pin=pin, feature_overrides=overrides), reason


def decide(
    config: DegradationConfig, state: ControllerState, signals: Signals, now: float
) -> tuple[ControllerState, Transition | None]:
    """One tick of the policy. See the module docstring for the rule."""
    before = state.level
    state, expired = _purge(state, now)
    values = signals.values
    damping = config.flap_damping
    if (
        state.flaps
        and state.last_escalate_at is not None
        and now - state.last_escalate_at >= damping.reset_after_s
    ):
        state = replace(state, flaps=0)  # a long calm: the bursts are over

    # 1. how long each level's trigger has held
    since: list[float | None] = []
    crossing: list[tuple[str, float, float] | None] = []
    for lv in (1, 2, 3):
        hot = _hottest(config.trigger_thresholds(lv), values)
        crossing.append(hot)
        prev = state.trigger_since[lv - 1]
        since.append((prev if prev is not None else now) if hot else None)
    state = replace(state, trigger_since=(since[0], since[1], since[2]))

    # 2. escalate to the highest level whose trigger held long enough
    target = Level.NORMAL
    for lv in (3, 2, 1):
        s = since[lv - 1]
        if s is not None and now - s >= config.escalate_after_s(lv):
            target = Level(lv)
            break
    reason: Reason | None = None
    current = state.policy_level
    if target > current:
        name, value, threshold = crossing[target - 1]  # type: ignore[misc]
        reason = Reason(
            "trigger", name, value, threshold, detail=f"level{int(target)} trigger held"
        )
        flap = state.last_recover_at is not None and now - state.last_recover_at <= damping.window_s
        state = replace(
            state,
            policy_level=target,
            last_change_at=now,
            calm_since=None,
            recovery_blocked_by=frozenset(),
            flaps=min(state.flaps + 1, _MAX_FLAPS) if flap else state.flaps,
            last_escalate_at=now,
        )
    elif current > Level.NORMAL:
        # 3. recover one step after an unbroken dwell below every recover value
        recover = config.recover_thresholds(current)
        blocked = frozenset(s for s in recover if s in signals.stale)
        hot = _hottest(recover, values)
        if blocked or hot:
            state = replace(state, calm_since=None, recovery_blocked_by=blocked)
        else:
            calm_since = state.calm_since if state.calm_since is not None else now
            factor = damping.factor(state.flaps)
            dwell_s = config.dwell_s(current) * factor
            dwell_ok = now - calm_since >= dwell_s
            cool_ok = state.last_change_at is None or now - state.last_change_at >= config.cooldown_s(
                current
            )
            if dwell_ok and cool_ok:
                damped = (
                    f" = {config.dwell_s(current):g}s x{factor:g} after {state.flaps} flap(s)"
                    if factor > 1.0
                    else ""
                )
                reason = Reason(
                    "recover",
                    detail=f"every level{int(current)} signal below its recover value for "
                    f"{now - calm_since:g}s (dwell {dwell_s:g}s{damped})",
                )
                state = replace(
                    state,
                    policy_level=Level(current - 1),
                    last_change_at=now,
                    last_recover_at=now,
                    # the next step's dwell starts now; the next tick checks the new level's
                    # recover values and restarts it on any crossing
                    calm_since=now,
                    recovery_blocked_by=frozenset(),
                )
            else:
                state = replace(state, calm_since=calm_since, recovery_blocked_by=frozenset())

    after = state.level
    if after == before:
        return state, None
    # decide() never sets a pin, so a change here is the rules acting or a pin expiring
    if expired is not None:
        reason = expired
    assert reason is not None
    return state, Transition(now, before, after, reason, signals)


# -- operator overrides ------------------------------------------------------------------------


def _expiry(now: float, ttl_s: float | None) -> float | None:
    if ttl_s is None:
        return None
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0 (or None for no expiry), got {ttl_s!r}")
    return now + ttl_s


def pin_level(
    state: ControllerState,
    level: int,
    now: float,
    ttl_s: float | None = None,
    note: str = "",
    signals: Signals | None = None,
) -> tuple[ControllerState, Transition | None]:
    """Pin the effective level (an operator override) until ``now + ttl_s`` or `unpin`."""
    if level not in tuple(Level):
        raise ValueError(f"level must be one of {[int(v) for v in Level]}, got {level!r}")
    pin = LevelPin(Level(level), _expiry(now, ttl_s), note)
    new = replace(state, pin=pin)
    return new, _changed(state, new, now, Reason("override", detail=f"level pinned at {level}"), signals)


def unpin(
    state: ControllerState, now: float, signals: Signals | None = None
) -> tuple[ControllerState, Transition | None]:
    """Clear a level pin; the effective level becomes what the rules decided meanwhile."""
    if state.pin is None:
        return state, None
    new = replace(state, pin=None)
    return new, _changed(state, new, now, Reason("override_cleared", detail="level pin cleared"), signals)


def force_feature(
    state: ControllerState, feature: str, on: bool, now: float, ttl_s: float | None = None
) -> ControllerState:
    """Force one feature on or off. Forcing a critical feature off is refused."""
    if feature not in feat.REGISTRY:
        raise ValueError(f"unknown feature {feature!r}; valid: {', '.join(sorted(feat.REGISTRY))}")
    if not on and feat.is_critical(feature):
        raise ValueError(f"feature {feature!r} is critical and cannot be forced off")
    overrides = dict(state.feature_overrides)
    overrides[feature] = FeatureOverride(feature, on, _expiry(now, ttl_s))
    return replace(state, feature_overrides=overrides)


def clear_feature(state: ControllerState, feature: str) -> ControllerState:
    if feature not in state.feature_overrides:
        return state
    overrides = {k: v for k, v in state.feature_overrides.items() if k != feature}
    return replace(state, feature_overrides=overrides)


def _changed(
    old: ControllerState, new: ControllerState, now: float, reason: Reason, signals: Signals | None
) -> Transition | None:
    if old.level == new.level:
        return None
    return Transition(now, old.level, new.level, reason, signals or Signals(at=now))


def enabled_features(config: DegradationConfig, state: ControllerState, now: float) -> frozenset[str]:
    """The features that run now: the level's rule, then unexpired feature overrides."""
    overrides = {k: o for k, o in state.feature_overrides.items() if o.active(now)}
    return feat.enabled_set(state.level, config.off_levels(), overrides)


# -- the naive baseline (reference design) -------------------------------------------------------


def naive_level(config: DegradationConfig, values: Mapping[str, float]) -> Level:
    """The reference design's naive manager: the highest level whose trigger holds, no memory."""
    for lv in (3, 2, 1):
        if _hottest(config.trigger_thresholds(lv), values) is not None:
            return Level(lv)
    return Level.NORMAL
