"""Every committed record is well-formed, has provenance, and comes from a benchmark that exists."""

import copy
import json

import pytest
from labkit import benchmarks, results
from labkit.results import Goal, Record

RECORDS = results.all_records()


@pytest.mark.parametrize("path,record", RECORDS, ids=[str(p.relative_to(results.results_root())) for p, _ in RECORDS])
def test_committed_record(path, record):
    assert results.validate(record) == []
    assert record["provenance"]["mode"] == "gpu", "only GPU runs are recorded"
    assert path.parent.name == results.device_slug(record["provenance"]["device"])
    assert path.stem == record["benchmark"]
    bench = benchmarks.get(record["benchmark"])  # KeyError: the benchmark no longer exists
    assert bench.chapter == record["chapter"]


def _good_record() -> dict:
    rec = Record(
        benchmark="demo.bench", chapter="demo", title="t", metric="TB/s",
        rows=[{"n": 1, "ours": 1.5}], limits={"copy_tbps": 4.0},
        goals=[Goal("ours/limit", 0.375, ">=", 0.9)],
        provenance={"mode": "gpu", "device": "NVIDIA H200", "sm_count": 132, "torch": "2.11",
                    "triton": "3.6", "cuda": "13.0", "date": "2026-12-02", "git_commit": "abc"},
    )
    return rec.to_dict()


def test_validate_accepts_a_good_record_and_round_trips():
    d = _good_record()
    assert results.validate(d) == []
    back = Record.from_dict(json.loads(json.dumps(d)))
    assert back.goals[0].met is False and back.recorded
    assert "recorded on NVIDIA H200 (132 SMs)" in back.label()


@pytest.mark.parametrize(
    "mutate,problem",
    [
        (lambda d: d.pop("provenance"), "missing field 'provenance'"),
        (lambda d: d.update(rows=[]), "rows is empty"),
        (lambda d: d["provenance"].pop("git_commit"), "provenance lacks 'git_commit'"),
        (lambda d: d["goals"][0].update(met=True), "'met' disagrees"),
        (lambda d: d["limits"].update(copy_tbps=-1), "must be a positive number"),
        (lambda d: d.update(extra=1), "unknown fields"),
        (lambda d: d["rows"][0].update(ours=float("nan")), "not finite"),
        (lambda d: d.update(schema=99), "schema 99"),
    ],
)
def test_validate_names_each_problem(mutate, problem):
    d = copy.deepcopy(_good_record())
    mutate(d)
    assert any(problem in p for p in results.validate(d)), results.validate(d)


def test_save_refuses_interpreter_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RESULTS", str(tmp_path))
    d = _good_record()
    d["provenance"]["mode"] = "cpu"
    with pytest.raises(ValueError, match="only GPU measurements are recorded"):
        results.save(Record.from_dict(d))


def test_save_and_load(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RESULTS", str(tmp_path))
    rec = Record.from_dict(_good_record())
    path = results.save(rec)
    assert path == tmp_path / "nvidia-h200" / "demo.bench.json"
    assert results.load("demo.bench").rows == rec.rows
    assert results.load("demo.bench", device="NVIDIA H200") is not None
    assert results.load("missing.bench") is None


def test_the_books_device_is_read_first(tmp_path, monkeypatch):
    """A record from another GPU (an H100's folder sorts before the H200's) is shown only for a
    benchmark the H200 has no record of."""
    monkeypatch.setenv("LABKIT_RESULTS", str(tmp_path))
    h200 = Record.from_dict(_good_record())
    results.save(h200)
    for name in ("demo.bench", "demo.other"):
        other = _good_record()
        other["benchmark"] = name
        other["provenance"]["device"] = "NVIDIA H100 80GB HBM3"
        other["rows"] = [{"n": 1, "ours": 123.0}]
        results.save(Record.from_dict(other))
    assert results.recorded_devices() == ["nvidia-h200", "nvidia-h100-80gb-hbm3"]
    assert results.load("demo.bench").provenance["device"] == "NVIDIA H200"
    assert results.load("demo.other").provenance["device"] == "NVIDIA H100 80GB HBM3"
    assert results.load("demo.bench", device="NVIDIA H100 80GB HBM3").rows == [{"n": 1, "ours": 123.0}]


def test_save_writes_undefined_numbers_as_null(tmp_path, monkeypatch):
    """NaN and infinities (a ratio over nothing) are saved as JSON null, never lost with the run."""
    monkeypatch.setenv("LABKIT_RESULTS", str(tmp_path))
    rec = Record.from_dict(_good_record())
    rec.rows[0]["ratio"] = float("nan")
    rec.config["summary"] = [{"acceptance": float("inf")}]
    rec.goals = [Goal("undefined", float("nan"), ">=", 1.0)]
    results.save(rec)
    back = results.load("demo.bench")
    assert back.rows[0]["ratio"] is None and back.config["summary"] == [{"acceptance": None}]
    assert back.goals[0].value is None and not back.goals[0].met


def test_goal_ops():
    assert Goal("g", 1.0, ">=", 0.9).met and not Goal("g", 1.0, "<=", 0.9).met
    assert not Goal("g", float("nan"), ">=", 0.0).met
    with pytest.raises(ValueError, match="goal op"):
        Goal("g", 1.0, ">", 0.9)


def test_provenance_has_versions_and_commit():
    p = results.provenance()
    assert {"mode", "torch", "triton", "python", "date", "git_commit", "device"} <= set(p)


def test_provenance_names_the_commit_given_in_the_environment(monkeypatch):
    """A tree copied to a GPU machine may carry a stale .git: the variable must win over it."""
    monkeypatch.setenv("LABKIT_GIT_COMMIT", "0123456789ab")
    assert results.provenance()["git_commit"] == "0123456789ab"


def test_commit_is_dirty_for_changed_code_but_not_for_new_records(monkeypatch, tmp_path):
    """Benchmarks run one after another write records into book/results: a later record of the
    same run must not call its commit dirty for them, while a changed source file does."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    (tmp_path / "book" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "book" / "results" / "a.json").write_text("{}\n")
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    monkeypatch.delenv("LABKIT_GIT_COMMIT", raising=False)
    monkeypatch.setattr(results, "REPO_ROOT", tmp_path)
    clean = results.provenance()["git_commit"]
    assert len(clean) == 12 and not clean.endswith("-dirty")
    (tmp_path / "book" / "results" / "a.json").write_text('{"new": 1}\n')
    assert results.provenance()["git_commit"] == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results.provenance()["git_commit"] == clean + "-dirty"


def test_config_fields_reads_back_a_recorded_autotuner_choice():
    import triton

    text = str(triton.Config({"BLOCK_N": 8, "CODE_WORDS": False}, num_warps=2, num_stages=3))
    fields = results.config_fields(text)
    assert fields["BLOCK_N"] == 8 and fields["CODE_WORDS"] is False
    assert fields["num_warps"] == 2 and fields["num_stages"] == 3
    with pytest.raises(ValueError, match="NAME: value"):
        results.config_fields("BLOCK_N=8")
