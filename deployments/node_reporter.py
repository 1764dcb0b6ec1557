"""One reporter per Ray node: the node's replicas report to it, and it sends their reports on to
the policy actor in batches (issue 14: reports batched per node).

Every replica (model, enrichment host, ingress) sends its signals with `signal_reporter` to the
`NodeReporter` of the node it runs on (`report_link`), a local call; the reporter's
`deployments.reporting.ReportBatcher` sends them on with ``report_batch``: routine reports at most
once per 0.5 s per node, a report that may raise the level at once. At a thousand replicas on a
hundred nodes the policy actor then answers at most two calls a second per node instead of four
per replica (`bench/policy_scale.py`, bench/POLICY_SCALE.md).

The reporter is a detached actor named ``brownout-reporter-<node id>`` in namespace
``brownout``, pinned to its node (``NodeAffinitySchedulingStrategy``, not soft), using no CPU.
The first replica on a node creates it (``get_if_exists``), the others find it. It is not
restarted (``max_restarts=0``): when it dies, its node's replicas' links find it gone and
create it again on their next report; when its node dies, it dies with the node's replicas
and their reports go stale at the actor, as they would without it. Sources stay per replica,
so ``brownout_policy_sources`` and staleness mean what they meant.
"""

from __future__ import annotations

from typing import Any

import ray

from deployments.reporting import ActorLink, ReportBatcher

REPORTER_PREFIX = "brownout-reporter-"


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=1000)
class NodeReporter:
    """Takes reports from the replicas of one node and sends them on in batches."""

    def __init__(self, node_id: str, policy_actor: tuple[str, str] | None = None) -> None:
        """``policy_actor``: (name, namespace) of a policy actor other than the shipped one (the
        scale benchmark's); None: the app's, created if it is not there."""
        self.node_id = node_id
        self._policy_actor = policy_actor
        self._batcher: ReportBatcher | None = None

    def _get_batcher(self) -> ReportBatcher:
        if self._batcher is None:  # made on the actor's event loop, where its sender task runs
            from policies.actor import get_or_create_policy_actor

            named = self._policy_actor
            resolve = get_or_create_policy_actor if named is None else (
                lambda: ray.get_actor(named[0], namespace=named[1]))
            self._batcher = ReportBatcher(ActorLink(resolve))
        return self._batcher

    async def report(self, source: str, signals: dict[str, float], stale: list[str] | None = None) -> bool:
        """Take ``source``'s report (as `policies.actor.PolicyActor.report`); True once it is taken,
        not once the actor has it (the actor counts what it rejects)."""
        self._get_batcher().put(source, signals, stale or ())
        return True

    async def state(self) -> dict[str, Any]:
        return {"node_id": self.node_id, **self._get_batcher().state()}


def reporter_name(node_id: str) -> str:
    return f"{REPORTER_PREFIX}{node_id}"


def get_or_create_node_reporter(namespace: str | None = None, policy_actor: tuple[str, str] | None = None) -> Any:
    """This node's reporter, creating it if no replica on the node has yet. ``namespace`` and
    ``policy_actor`` (`NodeReporter`): the scale benchmark's own; None: the app's."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from policies.actor import ACTOR_NAMESPACE

    node_id = ray.get_runtime_context().get_node_id()
    return NodeReporter.options(  # type: ignore[attr-defined]
        name=reporter_name(node_id), namespace=namespace or ACTOR_NAMESPACE, lifetime="detached",
        get_if_exists=True, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, policy_actor)


def report_link() -> ActorLink:
    """The link a replica reports through: to its node's reporter."""
    return ActorLink(get_or_create_node_reporter)
