"""A CPU engine keeps its cores to itself.

On a node without an accelerator the vLLM engine computes on CPU cores that every other process
of the node may also be scheduled on: Serve's proxy, the ingress and enrichment replicas, the
model replica's own front end, Ray's daemons. Linux spreads them over all cores, so they take
turns with the engine's compute thread, and every slice they take is a slice the batch waits.
On the 2-core machine of the benchmarks, at level 3 with a full batch, the engine-core's thread
ran 0.84 of a core and waited 0.17 s per second on the run queue; with its core kept to it, 0.96
and 0.04, and the service completed about a fifth more requests (`bench/cpu_isolation.py`, which
measures both side by side on one deployment; bench/RESULTS.md gives its figures). vLLM's CPU backend means to do this itself
(``VLLM_CPU_OMP_THREADS_BIND``: it keeps cores for the serving frontend and binds its compute
threads to the rest), but inside a Serve replica its binding did not take effect (every thread
of the engine-core process allowed on every core).

So when the engine runs on CPU, the model replica, once its engine has started, binds every
thread of the engine-core process (its child) to the engine's CPUs and moves the other
processes of its Ray node (the raylet and every worker it started: Serve's proxy and controller,
every replica, the model replica itself) to the remaining CPUs; workers started later inherit
the raylet's CPUs. Processes outside the raylet's tree (the GCS and dashboard on the head node,
a load generator, other software) are left alone, and so is any other engine-core process.
When the model replica stops it gives the node's CPUs back to the processes of the raylet's tree
still on the others (moved, or started since and so inherited them), unless another engine on
the node still has its CPUs to itself (a replacement replica that started first).

``model.cpu_isolation`` chooses (`plan`, pure and table-tested):

* ``auto`` (default): the engine gets as many CPUs as it has compute threads (``OMP_NUM_THREADS``
  of the replica, which Ray sets from the replica's ``num_cpus``), the last ones of the node,
  and never all of them (one at least stays for everything else); a node with one CPU has
  nothing to separate;
* ``off``: nothing is moved;
* a CPU list such as ``"1"`` or ``"2-7"``: the engine's CPUs, which must leave one of the node's.

Only on Linux and only for a CPU engine (on a GPU the engine's compute is not on these cores).
One CPU engine per node is what this plans for: a second model replica on the same node plans
the same CPUs for its engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_COMM = "VLLM::EngineCor"  # vLLM's process title, as /proc/<pid>/comm truncates it (15 chars)


@dataclass(frozen=True)
class Placement:
    """The engine's CPUs and everyone else's (disjoint, both non-empty)."""

    engine: tuple[int, ...]
    service: tuple[int, ...]


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"1"``, ``"0,2-3"`` -> sorted CPU ids; ``ValueError`` naming the text on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"cpu_isolation: {text!r} is not 'auto', 'off' or a CPU list such as '1' or '2-7'") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu_isolation: {text!r}: {part!r} is not a CPU range")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def check_setting(setting: str) -> str:
    """The setting as given if it is ``auto``, ``off`` or a CPU list; ``ValueError`` naming it."""
    if setting not in ("auto", "off"):
        parse_cpu_list(setting)
    return setting


def plan(setting: str, node_cpus: Sequence[int], engine_threads: int) -> tuple[Placement | None, str]:
    """Where the engine and everything else run, or ``(None, why not)``.

    ``node_cpus``: the CPUs this node's processes may use; ``engine_threads``: the engine's
    compute threads. An explicit CPU list outside ``node_cpus``, or one that takes all of them,
    is a ``ValueError`` naming it (a configuration error, not a silent fallback).
    """
    node = tuple(sorted(set(node_cpus)))
    if setting == "off":
        return None, "cpu_isolation is 'off'"
    if setting == "auto":
        if len(node) < 2:
            return None, f"this node allows {len(node)} CPU: nothing to separate"
        n = min(max(1, engine_threads), len(node) - 1)
        return Placement(engine=node[-n:], service=node[:-n]), "auto"
    engine = parse_cpu_list(setting)
    outside = sorted(set(engine) - set(node))
    if outside:
        raise ValueError(f"cpu_isolation: {setting!r} names CPU(s) {outside} this node does not allow "
                         f"(allowed: {list(node)})")
    service = tuple(c for c in node if c not in engine)
    if not service:
        raise ValueError(f"cpu_isolation: {setting!r} takes every CPU of this node ({list(node)}); "
                         "leave one for the other processes")
    return Placement(engine=engine, service=service), "explicit"


def descendants(parent_of: Mapping[int, int], root: int) -> set[int]:
    """``root`` and every process below it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parent_of.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo.extend(children.get(pid, ()))
    return out


# -- Linux ---------------------------------------------------------------------------------------

def parent_map() -> dict[int, int]:
    """Every process of this machine (as /proc shows it) -> its parent."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                # the comm field may hold spaces and parentheses: the ppid follows the last ')'
                out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def process_name(pid: int) -> str:
    """The process's name (/proc/<pid>/comm, at most 15 characters); "" if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def thread_ids(pid: int) -> list[int]:
    """The process's threads; [] if it is gone."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def set_process_cpus(pid: int, cpus: Iterable[int]) -> int:
    """Every thread of ``pid`` on ``cpus`` (``sched_setaffinity`` sets one thread); the number
    of threads set (0: the process is gone or not ours)."""
    mask = set(cpus)
    n = 0
    for tid in thread_ids(pid):
        try:
            os.sched_setaffinity(tid, mask)
            n += 1
        except OSError:  # a thread that ended meanwhile, or a process we may not change
            continue
    return n


def process_cpus(pid: int) -> tuple[int, ...] | None:
    """The CPUs ``pid`` (its main thread) may run on; None if it is gone or not visible."""
    try:
        return tuple(sorted(os.sched_getaffinity(pid)))
    except OSError:
        return None


def node_cpus() -> tuple[int, ...]:
    """The CPUs of this node (or container): those of its first process, which nothing here
    narrows; this process's own when that cannot be read."""
    return process_cpus(1) or tuple(sorted(os.sched_getaffinity(0)))


def compute_threads() -> int:
    """The engine's compute threads: ``OMP_NUM_THREADS``, which the engine-core process inherits
    from the replica (Ray sets it from the replica's ``num_cpus``); without it torch's count."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    import torch

    return int(torch.get_num_threads())


def children_named(parents: Mapping[int, int], pid: int, name: str) -> list[int]:
    """The processes started by ``pid`` whose name (`process_name`) is ``name``."""
    return sorted(p for p, pp in parents.items() if pp == pid and process_name(p) == name)


@dataclass
class Isolation:
    """What `isolate` did: shown in the model's stats (``/healthz``) and undone by `release`."""

    placement: Placement | None
    reason: str
    engine_pids: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    node: tuple[int, ...] = ()
    root: int | None = None  # the raylet (or this process) whose tree was moved

    def describe(self) -> dict[str, Any]:
        p = self.placement
        return {"active": p is not None and bool(self.engine_pids), "reason": self.reason,
                "engine_cpus": list(p.engine) if p else None, "service_cpus": list(p.service) if p else None,
                "engine_pids": list(self.engine_pids), "moved_processes": len(self.moved)}


def isolate(setting: str, engine_threads: int, on_cpu: bool, replica: int | None = None,
            engine_pids: Sequence[int] | None = None) -> Isolation:
    """Keep the replica's engine-core process on its CPUs and its Ray node's other processes
    off them (see the module docstring). Call from the model replica once the engine started;
    ``replica``: its pid (default: this process); ``engine_pids``: its engine-core processes as
    vLLM knows them (`LLMEngine.engine_core_pids`; those that are not the replica's children are
    left out). Without them, the replica's children titled ``VLLM::EngineCore``: the title is
    set by setproctitle in the engine-core process, and in CI it once did not take."""
    if not on_cpu:
        return Isolation(None, "the engine does not compute on CPU")
    if not os.path.isdir("/proc") or not hasattr(os, "sched_setaffinity"):
        return Isolation(None, "CPU affinity needs Linux")
    node = node_cpus()
    placement, reason = plan(setting, node, engine_threads)
    if placement is None:
        return Isolation(None, reason, node=node)
    me = os.getpid() if replica is None else replica
    parents = parent_map()
    engines = (sorted(p for p in set(engine_pids) if parents.get(p) == me) if engine_pids
               else children_named(parents, me, ENGINE_COMM))
    if not engines:
        return Isolation(None, "no engine-core process found under this replica", node=node)
    raylet = parents.get(me, -1)
    root = raylet if process_name(raylet) == "raylet" else me
    moved = []
    for pid in sorted(descendants(parents, root)):
        # every engine-core stays where it is: ours is placed below, another replica's (one being
        # replaced, say) must not land on the cores the rest of the node shares. Another's is
        # known by its title or, where the title did not take, by running alone on the engine's
        # CPUs, where only an isolation puts a process
        if (pid not in engines and process_name(pid) != ENGINE_COMM
                and process_cpus(pid) != placement.engine and set_process_cpus(pid, placement.service)):
            moved.append(pid)
    for pid in engines:
        set_process_cpus(pid, placement.engine)
    logger.info("CPU isolation (%s): engine-core %s on CPUs %s; %d processes of this Ray node on %s",
                reason, engines, list(placement.engine), len(moved), list(placement.service))
    return Isolation(placement, reason, engine_pids=engines, moved=moved, node=node, root=root)


def release(iso: Isolation) -> int:
    """Give the node's CPUs back to every process of the Ray node (the raylet's tree) that is
    on the rest-of-the-node CPUs: those `isolate` moved and those started since, which inherited
    them. Not while another engine-core process of the same tree still runs alone on the
    engine's CPUs (a replacement replica that started first): known by running alone on them,
    where only an isolation puts a process, titled ``VLLM::EngineCore`` or not (the title may
    not take: `isolate`); a process whose CPUs changed otherwise is left as it is. Returns how
    many processes got the node's CPUs back."""
    p = iso.placement
    if p is None or iso.root is None:
        return 0
    parents = parent_map()
    tree = descendants(parents, iso.root)
    ours = set().union(*(descendants(parents, pid) for pid in iso.engine_pids))  # with their children
    others = [pid for pid in sorted(tree) if pid not in ours and process_cpus(pid) == p.engine]
    if others:
        logger.info("CPU isolation kept: engine-core %s still runs on CPUs %s", others, list(p.engine))
        return 0
    n = 0
    for pid in sorted(tree):
        if pid not in iso.engine_pids and process_cpus(pid) == p.service and set_process_cpus(pid, iso.node):
            n += 1
    return n
