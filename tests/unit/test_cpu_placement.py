"""A CPU engine's cores to itself (`deployments.cpu_placement`): the plan as a table, then
`isolate` and `release` on real processes of this machine (a child that names itself as vLLM's
engine core does), where it has two CPUs or more."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError

from deployments import cpu_placement as cp
from deployments.cpu_placement import Placement, descendants, parse_cpu_list, plan
from deployments.engine import EngineSettings


@pytest.mark.parametrize(("setting", "node", "threads", "expected"), [
    ("auto", [0, 1], 1, Placement(engine=(1,), service=(0,))),  # this machine: one core each
    ("auto", [1, 0], 1, Placement(engine=(1,), service=(0,))),  # order of the node's list
    ("auto", list(range(16)), 4, Placement(engine=(12, 13, 14, 15), service=tuple(range(12)))),
    ("auto", [0, 1, 2, 3], 8, Placement(engine=(1, 2, 3), service=(0,))),  # never every CPU
    ("auto", [0, 1], 0, Placement(engine=(1,), service=(0,))),  # at least one for the engine
    ("auto", [4, 6, 7], 1, Placement(engine=(7,), service=(4, 6))),  # a cpuset with gaps
    ("1", [0, 1], 1, Placement(engine=(1,), service=(0,))),
    ("0", [0, 1], 1, Placement(engine=(0,), service=(1,))),
    ("2-3", list(range(8)), 1, Placement(engine=(2, 3), service=(0, 1, 4, 5, 6, 7))),
])
def test_plan(setting: str, node: list[int], threads: int, expected: Placement) -> None:
    placement, _ = plan(setting, node, threads)
    assert placement == expected
    assert not set(placement.engine) & set(placement.service)


@pytest.mark.parametrize(("setting", "node", "reason"), [
    ("off", [0, 1], "'off'"),
    ("auto", [0], "1 CPU"),  # nothing to separate
    ("auto", [], "0 CPU"),
])
def test_plan_nothing_to_do(setting: str, node: list[int], reason: str) -> None:
    placement, why = plan(setting, node, 1)
    assert placement is None and reason in why


@pytest.mark.parametrize(("setting", "node", "message"), [
    ("0-1", [0, 1], "takes every CPU"),
    ("5", [0, 1], "[5]"),
    ("1,9", [0, 1, 2], "[9]"),
])
def test_plan_rejects_a_list_the_node_cannot_hold(setting: str, node: list[int], message: str) -> None:
    with pytest.raises(ValueError, match="cpu_isolation") as err:
        plan(setting, node, 1)
    assert message in str(err.value) and repr(setting) in str(err.value)


@pytest.mark.parametrize(("text", "cpus"), [
    ("1", (1,)), ("0,2-3", (0, 2, 3)), (" 3 , 1 ", (1, 3)), ("2-2", (2,)), ("1,1-2", (1, 2)),
])
def test_parse_cpu_list(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["fast", "", "3-1", "-1", "1-", "1,,2", "a-b"])
def test_parse_cpu_list_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cpu_isolation"):
        parse_cpu_list(text)


def test_setting_is_validated_where_it_is_configured() -> None:
    for good in ("auto", "off", "1", "2-7"):
        assert EngineSettings(model="m", cpu_isolation=good).cpu_isolation == good
    with pytest.raises(ValidationError, match="cpu_isolation") as err:
        EngineSettings(model="m", cpu_isolation="fast")
    assert "'fast'" in str(err.value)


def test_descendants() -> None:
    parent_of = {2: 1, 3: 2, 4: 2, 5: 9, 6: 4, 1: 0}
    assert descendants(parent_of, 2) == {2, 3, 4, 6}
    assert descendants(parent_of, 5) == {5}
    assert descendants(parent_of, 7) == {7}


# -- on this machine's processes ------------------------------------------------------------------

needs_two_cpus = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(cp.node_cpus()) < 2 or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and two CPUs or more")

FAKE_ENGINE = ("import time\n"
               "with open('/proc/self/comm', 'w') as f: f.write('VLLM::EngineCore')\n"
               "time.sleep(60)\n")
# a stand-in model replica: starts an engine-core look-alike and one other child, prints their
# pids, and waits; its tree is all that `isolate` may touch here (its parent is no raylet)
FAKE_REPLICA = ("import subprocess, sys, time\n"
                f"e = subprocess.Popen([sys.executable, '-c', {FAKE_ENGINE!r}])\n"
                "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                "print(e.pid, b.pid, flush=True)\n"
                "time.sleep(60)\n")


def _wait_named(pid: int) -> None:
    deadline = time.monotonic() + 10
    while cp.process_name(pid) != cp.ENGINE_COMM:
        assert time.monotonic() < deadline, "the fake engine did not rename itself"
        time.sleep(0.02)


def _fake_replica() -> tuple[subprocess.Popen[str], int, int]:
    """(the stand-in replica, its engine-core look-alike's pid, its other child's pid)."""
    proc = subprocess.Popen([sys.executable, "-c", FAKE_REPLICA], stdout=subprocess.PIPE, text=True)
    engine, other = (int(x) for x in proc.stdout.readline().split())
    _wait_named(engine)
    return proc, engine, other


def _end(proc: subprocess.Popen[str], *pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def _threads_on(pid: int) -> set[tuple[int, ...]]:
    return {tuple(sorted(os.sched_getaffinity(t))) for t in cp.thread_ids(pid)}


@needs_two_cpus
def test_isolate_then_release_on_real_processes() -> None:
    node = cp.node_cpus()
    replica, engine, bystander = _fake_replica()
    mine = _threads_on(os.getpid())
    try:
        iso = cp.isolate("auto", 1, on_cpu=True, replica=replica.pid)
        described = iso.describe()
        assert described["active"] and described["engine_pids"] == [engine], described
        assert iso.root == replica.pid  # no raylet above it: the replica's own tree
        assert _threads_on(engine) == {iso.placement.engine}
        # the replica (every thread) and its other child: the rest of the node
        assert _threads_on(replica.pid) == {iso.placement.service}
        assert _threads_on(bystander) == {iso.placement.service}
        assert sorted(iso.moved) == sorted([replica.pid, bystander]) and engine not in iso.moved
        assert _threads_on(os.getpid()) == mine  # outside the tree: untouched

        # one on the rest-of-node CPUs that isolate did not move (started since, it inherited
        # them from the raylet): given back too
        late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            cp.set_process_cpus(late.pid, iso.placement.service)
            late_iso = cp.Isolation(iso.placement, iso.reason, [], [], iso.node, root=late.pid)
            assert cp.release(late_iso) == 1 and _threads_on(late.pid) == {node}
        finally:
            late.kill()
            late.wait()

        assert cp.release(iso) == len(iso.moved)
        assert _threads_on(replica.pid) == {node} and _threads_on(bystander) == {node}
    finally:
        _end(replica, engine, bystander)


@needs_two_cpus
def test_isolate_takes_the_engine_pids_vllm_gives_where_the_title_did_not_take() -> None:
    """The engine-core child keeps its interpreter's name (setproctitle did not take, as once in
    CI): the pid vLLM reports places it; a pid that is not the replica's child is left out; a
    process of the tree alone on the engine's CPUs (another replica's engine, untitled) stays."""
    node = cp.node_cpus()
    untitled = FAKE_REPLICA.replace(repr(FAKE_ENGINE), repr("import time; time.sleep(60)"))
    proc = subprocess.Popen([sys.executable, "-c", untitled], stdout=subprocess.PIPE, text=True)
    engine, other = (int(x) for x in proc.stdout.readline().split())
    try:
        assert cp.process_name(engine) != cp.ENGINE_COMM
        assert cp.isolate("auto", 1, on_cpu=True, replica=proc.pid).placement is None  # by title: none
        assert cp.isolate("auto", 1, on_cpu=True, replica=proc.pid, engine_pids=[os.getpid()]).placement is None
        cp.set_process_cpus(other, node[-1:])  # as an isolation before this one left another engine
        iso = cp.isolate("auto", 1, on_cpu=True, replica=proc.pid, engine_pids=[engine, os.getpid()])
        assert iso.describe()["active"] and iso.engine_pids == [engine], iso.describe()
        assert _threads_on(engine) == {iso.placement.engine} == {node[-1:]}
        assert _threads_on(other) == {node[-1:]} and other not in iso.moved
        assert iso.moved == [proc.pid] and _threads_on(proc.pid) == {iso.placement.service}
        assert cp.release(iso) == 0  # the other untitled engine still runs alone on those CPUs
        cp.set_process_cpus(other, node)
        assert cp.release(iso) == 1 and _threads_on(proc.pid) == {node}  # ours stays, it is ours
        assert _threads_on(engine) == {node[-1:]}
    finally:
        _end(proc, engine, other)


@needs_two_cpus
def test_release_waits_for_another_engine_and_leaves_what_someone_else_moved() -> None:
    node = cp.node_cpus()
    placement = Placement(engine=node[-1:], service=node[:-1])
    replica, engine, bystander = _fake_replica()
    try:
        # an engine of the same tree (not this isolation's: a replacement) alone on the engine's
        # CPUs: nothing is given back
        cp.set_process_cpus(replica.pid, placement.service)
        cp.set_process_cpus(bystander, placement.service)
        cp.set_process_cpus(engine, placement.engine)
        iso = cp.Isolation(placement, "auto", engine_pids=[], moved=[replica.pid, bystander], node=node,
                           root=replica.pid)
        assert cp.release(iso) == 0
        assert _threads_on(bystander) == {placement.service}
        # that engine gone from the engine's CPUs, and an untitled process alone on them (an
        # engine whose title did not take): still nothing given back
        cp.set_process_cpus(engine, node)
        cp.set_process_cpus(bystander, placement.engine)
        assert cp.release(iso) == 0 and _threads_on(replica.pid) == {placement.service}
        # the bystander moved by someone else since: only the replica, still on the rest-of-node
        # CPUs, gets the node's back
        cp.set_process_cpus(bystander, node)
        assert cp.release(iso) == 1
        assert _threads_on(replica.pid) == {node} and _threads_on(bystander) == {node}
    finally:
        _end(replica, engine, bystander)


def test_nothing_is_moved_for_a_gpu_engine_or_without_an_engine_process() -> None:
    iso = cp.isolate("auto", 1, on_cpu=False)
    assert iso.placement is None and "not compute on CPU" in iso.reason and iso.describe()["active"] is False
    assert cp.isolate("off", 1, on_cpu=True).describe()["active"] is False
    if len(cp.node_cpus()) >= 2:
        iso = cp.isolate("auto", 1, on_cpu=True)  # this process has no engine-core child
        assert iso.placement is None and "no engine-core process" in iso.reason and not iso.moved


@needs_two_cpus
def test_the_benchmark_undoes_and_redoes_the_placement() -> None:
    """`bench/cpu_isolation.py`'s phases: A puts a Ray node's tree and its engine back on every CPU,
    I puts them where the model replica had them."""
    from bench.cpu_isolation import place

    node = cp.node_cpus()
    tree = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        place(tree.pid, engine.pid, [node[-1]], list(node[:-1]))
        assert _threads_on(tree.pid) == {node[:-1]} and _threads_on(engine.pid) == {node[-1:]}
        place(tree.pid, engine.pid, None, None)
        assert _threads_on(tree.pid) == {node} and _threads_on(engine.pid) == {node}
    finally:
        for p in (tree, engine):
            p.kill()
            p.wait()
