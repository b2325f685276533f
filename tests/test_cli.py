import subprocess
import sys

import labkit
import pytest


def _cli(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=600)


def test_bench_lists_benchmarks():
    out = _cli("labkit.bench", "--list")
    assert out.returncode == 0, out.stderr


def test_bench_unknown_selection_is_a_clear_error():
    out = _cli("labkit.bench", "no-such-chapter")
    assert out.returncode == 2 and "neither a benchmark nor a chapter" in out.stderr


@pytest.mark.skipif(labkit.on_gpu(), reason="checks the refusal on a machine without a GPU")
def test_record_refuses_without_gpu():
    out = _cli("labkit.record")
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_record_unknown_chapter():
    if not labkit.on_gpu():
        pytest.skip("record refuses before selecting on a CPU machine")
    out = _cli("labkit.record", "no-such-chapter")
    assert out.returncode == 2


def test_record_reports_where_a_failure_without_a_message_was_raised(monkeypatch, capsys):
    """An error with no message (the notebook client's bare assert) still says where it came from;
    one with a message (a cell's traceback) is printed as it is, and the run goes on to the next."""
    from types import SimpleNamespace

    from labkit import record

    def client_fails(path, timeout_s):
        raise AssertionError()

    def cell_fails(path, timeout_s):
        raise RuntimeError("cell 7 raised ZeroDivisionError")

    chapters = [SimpleNamespace(id="first", part="p", path="first.ipynb"),
                SimpleNamespace(id="second", part="p", path="second.ipynb")]
    failures = iter([client_fails, cell_fails])
    # main setdefaults LABKIT_MODE=gpu; a value set here is one monkeypatch restores, where
    # delenv of an unset variable records nothing and the gpu mode would leak into later notebooks.
    monkeypatch.setenv("LABKIT_MODE", "cpu")
    monkeypatch.setattr(record.backend, "on_gpu", lambda: True)
    monkeypatch.setattr(record.book, "select", lambda selection: chapters)
    monkeypatch.setattr(record.results, "all_records", lambda: [])
    monkeypatch.setattr(record, "execute_notebook", lambda path, timeout_s: next(failures)(path, timeout_s))
    assert record.main(["p"]) == 1
    out = capsys.readouterr().out
    first, second = out.split("-- second")
    assert "FAILED: AssertionError: Traceback" in first and "in client_fails" in first
    assert "FAILED: RuntimeError: cell 7 raised ZeroDivisionError" in second and "Traceback" not in second
    assert '"failed": ["first", "second"]' in out
