import pytest
from labkit import backend, benchmarks, results
from labkit.benchmarks import Measurement


@pytest.fixture
def demo(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_RESULTS", str(tmp_path))
    monkeypatch.setattr(benchmarks, "REGISTRY", dict(benchmarks.discover()))

    @benchmarks.benchmark("demo.sum", chapter="demo-chapter", title="a demo")
    def demo_sum():
        return Measurement(rows=[{"n": n, "ours": float(n)} for n in (1, 2)], metric="units",
                           limits={"copy_tbps": 1.0},
                           goals=[results.Goal("ours at 2", 2.0, ">=", 1.0)])

    return demo_sum


def test_run_builds_a_valid_record(demo):
    rec = benchmarks.run("demo.sum", record=False)
    assert rec.chapter == "demo-chapter" and rec.rows[1]["ours"] == 2.0
    assert results.validate(rec.to_dict()) == []
    assert rec.goals[0].met


def test_select_by_name_and_chapter(demo):
    assert [b.name for b in benchmarks.select(["demo-chapter"])] == ["demo.sum"]
    assert [b.name for b in benchmarks.select(["demo.sum"])] == ["demo.sum"]
    with pytest.raises(KeyError, match="neither a benchmark nor a chapter"):
        benchmarks.select(["nope"])


def test_obtain_without_gpu_prefers_the_record(demo, monkeypatch):
    monkeypatch.setattr(benchmarks.backend, "on_gpu", lambda: False)
    live = benchmarks.obtain("demo.sum")
    assert not live.recorded  # nothing recorded: measured live under the interpreter
    with pytest.raises(KeyError, match="no benchmark named"):
        benchmarks.obtain("demo.typo")


def test_registry_rejects_a_second_function_under_one_name(demo):
    with pytest.raises(ValueError, match="already registered"):
        @benchmarks.benchmark("demo.sum", chapter="x", title="y")
        def other():  # pragma: no cover - never called
            raise AssertionError


def test_bad_benchmark_names_and_results(demo):
    with pytest.raises(ValueError, match="plain non-empty string"):
        benchmarks.benchmark("a/b", chapter="c", title="t")

    @benchmarks.benchmark("demo.bad", chapter="demo-chapter", title="returns the wrong thing")
    def bad():
        return {"rows": []}

    with pytest.raises(TypeError, match="not a Measurement"):
        benchmarks.run("demo.bad", record=False)


def test_every_registered_benchmark_belongs_to_a_chapter_of_the_book():
    from labkit import book

    ids = {c.id for c in book.chapters()}
    for b in benchmarks.discover().values():
        assert b.chapter in ids, f"{b.name} names chapter {b.chapter!r}, which is not in _toc.yml"


def test_progress_passes_items_through_and_is_silent_off_the_gpu(capsys, monkeypatch):
    """A GPU run shows a progress line per part on stderr; a CPU run (a notebook's live
    interpreter run) shows none, and the items are the same either way."""
    monkeypatch.setattr(backend, "on_gpu", lambda: False)
    assert list(benchmarks.progress(iter([3, 1, 2]), "parts")) == [3, 1, 2]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(backend, "on_gpu", lambda: True)
    assert list(benchmarks.progress([3, 1, 2], "parts")) == [3, 1, 2]
    assert "parts" in capsys.readouterr().err
