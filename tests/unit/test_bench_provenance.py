"""bench/provenance.py: the commit and uncommitted files a run measured, and a portable command line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import provenance

ROOT = provenance.ROOT


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "rule.py").write_text("A = 1\n")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "run.py").write_text("B = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_a_clean_checkout_names_its_commit_and_nothing_uncommitted(repo: Path) -> None:
    state = provenance.code_state(repo)
    assert state == {"commit": _git(repo, "rev-parse", "--short=7", "HEAD"), "uncommitted": []}


def test_changed_files_are_listed_but_results_written_by_the_run_are_not(repo: Path) -> None:
    (repo / "policies" / "rule.py").write_text("A = 2\n")
    (repo / "bench" / "new.py").write_text("")
    (repo / "bench" / "results" / "run.json").write_text("{}")
    state = provenance.code_state(repo)
    assert state["uncommitted"] == [" M policies/rule.py", "?? bench/new.py"]
    assert provenance.code_state(repo, ["bench"])["uncommitted"] == ["?? bench/new.py"]
    assert provenance.code_state(repo, ["policies"])["uncommitted"] == [" M policies/rule.py"]


def test_outside_a_checkout_the_commit_is_unknown_not_guessed(tmp_path: Path) -> None:
    (tmp_path / "export").mkdir()
    assert provenance.code_state(tmp_path / "export") == {"commit": None, "uncommitted": []}
    assert provenance.code_state(tmp_path / "missing") == {"commit": None, "uncommitted": []}


@pytest.mark.parametrize("arg, expected", [
    ("--raw", "--raw"),
    ("3", "3"),
    ("bench/results/x.json", "bench/results/x.json"),
    ("/var/tmp/run/raw.jsonl", "<outside>/raw.jsonl"),
    ("--out=/var/tmp/o.json", "--out=<outside>/o.json"),
    ("--out=o.json", "--out=o.json"),
    ("-", "-"),
    ("{root}/bench/results/a.json", "bench/results/a.json"),
    ("--out={root}/bench/../bench/results/a.json", "--out=bench/results/a.json"),
    ("{root}", "."),
])
def test_portable_arg(arg: str, expected: str) -> None:
    assert provenance.portable_arg(arg.format(root=ROOT)) == expected


def test_the_command_line_carries_no_path_of_the_machine() -> None:
    line = provenance.command_line("bench/overload.py", ["--seed", "7", "--raw", "/var/tmp/r.jsonl",
                                                         "--out-dir", str(ROOT / "bench" / "results")])
    assert line == "bench/overload.py --seed 7 --raw <outside>/r.jsonl --out-dir bench/results"


def test_the_overload_report_records_the_code_read_at_start() -> None:
    from bench import overload

    args = overload.build_parser().parse_args(["--quick", "--seed", "3"])
    args.argv = ["--quick", "--seed", "3", "--raw", "/var/tmp/r.jsonl"]
    args.code = {"commit": "abc1234", "uncommitted": [" M policies/admission.py"]}
    meta = overload.meta(overload.Plan(args), args, 1.0, {})
    assert meta["command"] == "bench/overload.py --quick --seed 3 --raw <outside>/r.jsonl"
    assert (meta["code_commit"], meta["uncommitted"]) == ("abc1234", [" M policies/admission.py"])


def test_a_result_files_meta_carries_the_command_code_machine_settings_and_wall_time() -> None:
    import time

    code = {"commit": "abc1234", "uncommitted": [" M bench/x.py"]}
    meta = provenance.run_meta("bench/x.py", ["--out", str(provenance.ROOT / "bench/results/x.json")], code,
                               time.monotonic() - 2.0, {"cpus": 2}, seconds=30)
    assert meta["command"] == "bench/x.py --out bench/results/x.json"
    assert (meta["code_commit"], meta["uncommitted"], meta["machine"], meta["seconds"]) == (
        "abc1234", [" M bench/x.py"], {"cpus": 2}, 30)
    assert 2.0 <= meta["wall_s"] < 60 and list(meta)[-1] == "wall_s"
    assert time.strptime(meta["date_utc"], "%Y-%m-%dT%H:%M:%SZ")


def test_a_result_file_is_indented_json_in_a_folder_made_for_it(tmp_path: Path) -> None:
    import json

    path = tmp_path / "new" / "r.json"
    provenance.write_result(path, {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
