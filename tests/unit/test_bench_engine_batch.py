"""The pure parts of bench/engine_batch.py: the window's figures and the ratio's ceiling."""

from __future__ import annotations

import pytest

from bench.engine_batch import ceiling, meets_both, parse_concurrency, row


def test_a_window_counts_completions_within_it_and_latencies_of_requests_wholly_inside() -> None:
    spans = [(0.0, 1.5),   # sent before the window, done inside: a completion, not a latency
             (1.0, 2.0),   # inside
             (2.0, 3.5),   # inside
             (3.0, 5.0)]   # done after the window: neither
    r = row(2, spans, start=1.0, end=4.0)
    assert r["completed"] == 3 and r["measured"] == 2
    assert r["throughput_rps"] == 1.0
    # the project's one percentile (numpy's linear rule): 1.0 + 0.99 x (1.5 - 1.0) s
    assert r["e2e_ms_p50"] == 1250.0 and r["e2e_ms_p99"] == 1495.0


def test_a_window_with_nothing_measured_is_an_error() -> None:
    with pytest.raises(ValueError, match="no request"):
        row(1, [(0.0, 5.0)], start=1.0, end=4.0)
    with pytest.raises(ValueError, match="empty window"):
        row(1, [(0.0, 1.0)], start=2.0, end=2.0)


ROWS = [
    {"concurrency": 1, "throughput_rps": 2.5, "e2e_ms_p50": 380.0, "e2e_ms_p99": 420.0},
    {"concurrency": 8, "throughput_rps": 10.0, "e2e_ms_p50": 800.0, "e2e_ms_p99": 950.0},
    {"concurrency": 16, "throughput_rps": 14.0, "e2e_ms_p50": 1100.0, "e2e_ms_p99": 1400.0},
]


@pytest.mark.parametrize(
    ("served", "concurrency", "p99_ceiling", "p50_ceiling"),
    [
        (2.0, 1, 16.67, 18.42),    # a light load: one request in flight carries it
        (10.0, 8, 7.37, 8.75),     # exactly the rate of 8 in flight
        (12.0, 16, 5.0, 6.36),     # past 8's rate: the next measured concurrency
        (14.5, None, None, None),  # more than any measured concurrency completed: no bound
    ],
)
def test_the_ceiling_is_pinned0_p99_over_the_engine_alone_at_the_lowest_concurrency_that_carries_the_rate(
        served: float, concurrency: int | None, p99_ceiling: float | None, p50_ceiling: float | None) -> None:
    c = ceiling(ROWS, served, pinned0_p99_ms=7000.0)
    assert c["concurrency"] == concurrency
    assert c["ratio_ceiling_p99"] == p99_ceiling and c["ratio_ceiling_p50"] == p50_ceiling


def test_both_items_are_the_issues_two_thresholds() -> None:
    assert meets_both(0.95, 5.0)
    assert not meets_both(0.9499, 9.0) and not meets_both(1.0, 4.99)


def test_the_concurrency_list_is_checked() -> None:
    assert parse_concurrency("1, 4,16") == [1, 4, 16]
    for bad in ("", "1,x", "0,4"):
        with pytest.raises(SystemExit, match="--concurrency"):
            parse_concurrency(bad)


def test_the_engine_mode_is_config_true_or_false(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import engine_batch

    with pytest.raises(SystemExit) as refused:
        engine_batch.main(["--enforce-eager", "maybe"])
    assert refused.value.code == 2 and "--enforce-eager" in capsys.readouterr().err


def test_every_benchmarks_engine_settings_come_from_the_model_args() -> None:
    from bench.engine_batch import engine_settings

    model = {"source": "embedded:tiny", "max_num_seqs": 8, "max_model_len": 512, "enforce_eager": False}
    assert engine_settings(model) == {"max_num_seqs": 8, "max_model_len": 512, "enforce_eager": False,
                                      "dtype": "auto", "seed": 0}
    assert engine_settings({**model, "dtype": "float32"})["dtype"] == "float32"


def test_an_engine_built_directly_gets_the_dtype_brownout_resolves_auto_to(monkeypatch: pytest.MonkeyPatch) -> None:
    import deployments.engine
    from bench.engine_batch import direct_engine, engine_settings

    model = {"source": "embedded:tiny", "max_num_seqs": 8, "max_model_len": 512, "enforce_eager": False}
    monkeypatch.setattr(deployments.engine, "_cpu_flags", lambda: frozenset({"avx2"}))  # no native bfloat16
    assert direct_engine(engine_settings(model)) == {**engine_settings(model), "dtype": "float32"}
    monkeypatch.setattr(deployments.engine, "_cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert direct_engine(engine_settings(model))["dtype"] == "auto"  # the model's bfloat16, native here
    assert direct_engine(engine_settings({**model, "dtype": "bfloat16"}))["dtype"] == "bfloat16"  # explicit: kept


def test_the_side_by_side_benchmark_gives_its_engines_serve_configs_settings() -> None:
    from bench import overhead
    from bench.engine_batch import engine_args

    model = engine_args()
    assert {k: overhead.ENGINE[k] for k in ("max_num_seqs", "max_model_len", "enforce_eager")} == {
        k: model[k] for k in ("max_num_seqs", "max_model_len", "enforce_eager")}


def test_an_overload_result_gets_a_ceiling_per_adaptive_run_at_1_5x() -> None:
    from bench.engine_batch import overload_ceilings

    def run(name: str, rps: float, p99: float) -> dict:
        return {"name": name, "overall": {"throughput_rps": rps, "e2e_ms": {"p99": p99}}}

    doc = {"runs": [run("pinned0 @1.5x", 12.0, 7000.0), run("adaptive @1.5x", 9.0, 1200.0),
                    run("adaptive @1.5x standard", 13.0, 1500.0), run("adaptive @3x", 14.0, 1700.0)]}
    c = overload_ceilings(ROWS, doc, "f.json")
    assert c["pinned0_p99_ms"] == 7000.0
    assert c["adaptive @1.5x"]["concurrency"] == 8 and c["adaptive @1.5x"]["measured_ratio"] == 5.83
    assert c["adaptive @1.5x standard"]["ratio_ceiling_p99"] == 5.0
    with pytest.raises(SystemExit, match="pinned0 @1.5x"):
        overload_ceilings(ROWS, {"runs": doc["runs"][1:]}, "g.json")


def test_latency_between_measured_concurrencies_is_linear_and_flat_outside() -> None:
    from bench.engine_batch import latency_at

    assert latency_at(ROWS, 1) == 0.38 and latency_at(ROWS, 0.5) == 0.38
    assert latency_at(ROWS, 12) == pytest.approx(0.95)
    assert latency_at(ROWS, 20) == 1.1


def test_the_simulated_door_trades_refusals_for_latency() -> None:
    from bench.engine_batch import simulate_door

    light = simulate_door(ROWS, 1.0, 0, 16, slo_s=2.0, horizon_s=2000)
    assert light["refused"] < 0.001 and light["within_slo"] > 0.99  # 1 req/s on 16 slots: nobody waits
    # one slot and no waiting room, an M/G/1/1 loss system: refused = A / (1 + A), A = rate x 0.38 s
    alone = simulate_door(ROWS, 1.0, 0, 1, slo_s=2.0, horizon_s=20000)
    assert alone["refused"] == pytest.approx(0.38 / 1.38, abs=0.01)
    assert alone["p99_s"] == pytest.approx(0.38)
    rooms = [simulate_door(ROWS, 14.0, w, 16, slo_s=2.0, horizon_s=3000) for w in (0, 4, 12)]
    assert rooms[0]["refused"] > rooms[1]["refused"] > rooms[2]["refused"]
    assert rooms[0]["p99_s"] < rooms[1]["p99_s"] < rooms[2]["p99_s"]


def test_the_frontier_says_whether_any_waiting_room_meets_both() -> None:
    from bench.engine_batch import frontier

    # far below capacity nobody waits or is refused: p99 is 16 in flight's at most
    easy = frontier(ROWS, 2.0, pinned0_p99_ms=7000.0, slots=16, slo_s=2.0, rooms=(0, 4), horizon_s=1000)
    assert easy["both"] is True
    # pinned level 0 barely slower than the engine alone: no door makes the ratio 5
    hard = frontier(ROWS, 13.0, pinned0_p99_ms=2000.0, slots=16, slo_s=2.0, rooms=(0, 4), horizon_s=1000)
    assert hard["both"] is False and all(p["ratio"] < 5 for p in hard["points"])


def test_the_model_capacity_grows_with_the_slo_and_both_items_hold_only_below_it() -> None:
    from bench.engine_batch import highest_rate_meeting_both, model_capacity

    tight = model_capacity(ROWS, 16, slo_s=1.5, horizon_s=800)
    loose = model_capacity(ROWS, 16, slo_s=3.0, horizon_s=800)
    assert 0 < tight < loose <= 14.0 * 1.5
    # a pinned level 0 no slower than one request alone: the ratio is never 5
    assert highest_rate_meeting_both(ROWS, 16, 2.0, pinned0_p99_ms=1000.0, step_rps=2.0, horizon_s=500) is None
    both = highest_rate_meeting_both(ROWS, 16, 2.0, pinned0_p99_ms=7000.0, step_rps=2.0, horizon_s=500)
    assert both is not None and 2.0 <= both <= model_capacity(ROWS, 16, 2.0, horizon_s=800) + 2.0
