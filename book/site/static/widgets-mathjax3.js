// ipywidgets 8 typesets widget labels through the MathJax 2 API, MathJax.Hub.Queue(["Typeset",
// MathJax.Hub, element]), which throws on the book's pages: they load MathJax 3. This routes
// those calls to MathJax 3. Loaded only on pages that have both widgets and math.
(function () {
  // Jupyter writes a label's math between dollars; the book's MathJax 3 reads \( \) and \[ \].
  const delimit = (element) => {
    element.textContent = element.textContent
      .replace(/\$\$([^$]+)\$\$/g, "\\[$1\\]")
      .replace(/\$([^$]+)\$/g, "\\($1\\)");
  };
  const early = []; // labels rendered before MathJax 3 has started
  const typeset = (elements) =>
    window.MathJax.typesetPromise(elements).catch((err) => console.warn("MathJax:", err));
  const hub = {
    Queue(command) {
      const element = command[2];
      delimit(element);
      if (window.MathJax.typesetPromise) typeset([element]);
      else early.push(element);
    },
  };
  // Until MathJax 3 loads, window.MathJax is its configuration object (set by Sphinx).
  const config = (window.MathJax = window.MathJax || {});
  config.Hub = hub;
  const startup = (config.startup = config.startup || {});
  const ready = startup.ready;
  startup.ready = function () {
    if (ready) ready();
    else window.MathJax.startup.defaultReady();
    window.MathJax.Hub = hub; // MathJax 3 has replaced the global object by now
    window.MathJax.startup.promise.then(() => typeset(early));
  };
})();
