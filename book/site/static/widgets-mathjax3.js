// ipywidgets 8 typesets widget labels through the MathJax 2 API, MathJax.Hub.Queue(["Typeset",
// MathJax.Hub, element]), which throws on the book's pages: they load MathJax 3. This routes
// those calls to MathJax 3. Loaded only on pages that have both widgets and math.
(function () {
  const hub = {
    Queue(command) {
      const element = command[2];
      // Before MathJax 3 has started, its first typeset of the page covers the element.
      if (window.MathJax.typesetPromise) {
        window.MathJax.typesetPromise([element]).catch((err) => console.warn("MathJax:", err));
      }
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
  };
})();
