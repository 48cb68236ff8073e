// MathJax for pymdownx.arithmatex (generic mode): it wraps \( \) and \[ \] in
// elements of class "arithmatex"; typeset only those, again after every page
// change of mkdocs-material's instant navigation.
window.MathJax = {
  tex: {
    inline: [["\\(", "\\)"]],
    display: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    MathJax.startup.output.clearCache();
    MathJax.typesetClear();
    MathJax.texReset();
    MathJax.typesetPromise();
  });
}
