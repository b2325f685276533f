import plotly.graph_objects as go
import pytest
from labkit import check, plots, source
from labkit.results import Goal, Record


def test_slider_figure_toggles_precomputed_states():
    frames = {n: [go.Scatter(x=[0, 1], y=[0, n]), go.Scatter(x=[0], y=[n])] for n in (1, 2, 3)}
    fig = plots.slider_figure(frames, title="t", slider_label="n")
    assert len(fig.data) == 6
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["1", "2", "3"]
    assert steps[1].args[0]["visible"] == [False, False, True, True, False, False]
    assert [t.visible for t in fig.data] == [True, True, False, False, False, False]


def test_slider_figure_rejects_ragged_frames():
    with pytest.raises(ValueError, match="same number of traces"):
        plots.slider_figure({"a": [go.Scatter()], "b": []}, title="t", slider_label="x")
    with pytest.raises(ValueError, match="at least one frame"):
        plots.slider_figure({}, title="t", slider_label="x")


def test_dropdown_figure_uses_a_menu():
    fig = plots.dropdown_figure({"fp32": [go.Bar(y=[1])], "bf16": [go.Bar(y=[2])]}, title="t")
    assert not fig.layout.sliders and len(fig.layout.updatemenus[0].buttons) == 2


def test_roofline_sweep_ratio_and_caption():
    fig = plots.roofline(peak_tflops=700, peak_tbps=4.0, points=[{"name": "gemv", "intensity": 1.0, "tflops": 3.5}])
    assert fig.data[0].y.max() == pytest.approx(700) and fig.data[1].name == "gemv"
    rows = [{"n": 1, "a": 1.0, "b": 2.0}, {"n": 10, "a": 2.0, "b": 3.0}]
    fig = plots.sweep(rows, x="n", series={"ours": "a", "torch": "b"}, title="t", x_title="n", y_title="y",
                      hlines={"copy": 4.0})
    assert [t.name for t in fig.data] == ["ours", "torch"]
    fig = plots.ratio_bars(["s"], {"vs torch": [1.5]}, title="t", goal=1.1)
    assert fig.data[0].text == ("1.50x",)
    rec = Record("d.b", "c", "t", "m", rows=[{"x": 1}], goals=[Goal("g", 1, ">=", 1)], provenance={"mode": "cpu"})
    fig = plots.provenance_caption(go.Figure(), rec)
    assert "not GPU performance" in fig.layout.annotations[0].text


def test_show_source_reads_the_package():
    header, code = source.source_of(check.rel_error)
    assert header.startswith("src/labkit/check.py, lines ")
    assert code.startswith("def rel_error(")
    html = source.show_source(check.rel_error).data
    assert "rel_error" in html and "labkit-source" in html
    with pytest.raises(TypeError, match="cannot show the source"):
        source.source_of(3)
    with pytest.raises(ValueError, match="at least one object"):
        source.show_source()


def test_show_code_highlights_text_and_refuses_empty():
    html = source.show_code("labkit.native.sources.FFI_CPU_ENTRY", "void f(int x) { return; }\n").data
    assert "labkit.native.sources.FFI_CPU_ENTRY" in html and "labkit-source" in html
    with pytest.raises(ValueError, match="non-empty"):
        source.show_code("empty", "  \n")
