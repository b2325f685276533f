"""IPython startup file for the kernels that build the book (not for readers' kernels).

``offline_assets.py`` copies it into the build's own ``IPYTHONDIR``. Plotly's default
renderer in a kernel emits ``application/vnd.plotly.v1+json``, which Jupyter Book does
not render, so figures would vanish from the site; its ``HtmlRenderer`` emits HTML but
always adds a ``<script>`` that loads MathJax from a CDN. This renderer emits a ``<div>``
and a ``Plotly.newPlot`` call, and nothing else: plotly.js comes once from the site's
``_static/`` (added to the pages that draw figures), and MathJax from there too, on the
pages whose text has math.
"""

import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer


class OfflineHtmlRenderer(MimetypeRenderer):
    def to_mimebundle(self, fig_dict):
        html = pio.to_html(
            fig_dict, full_html=False, include_plotlyjs=False, include_mathjax=False,
            auto_play=False, default_width="100%", default_height=525, validate=False,
        )
        return {"text/html": html}


pio.renderers["labkit_book"] = OfflineHtmlRenderer()
pio.renderers.default = "labkit_book"
