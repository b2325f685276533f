# ML Systems Lab. The two commands a new reader needs:
#   make book    build the website into _build/html (executes the notebooks)
#   make test    run the whole test suite
# Both create .venv and install requirements.txt, pinned by requirements.lock, and labkit
# (editable) on first use. `make lock` re-resolves the pins.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The site's browser libraries (package.json, pinned by package-lock.json) and the browser
# its test drives (Debian's Chromium).
NPM_STAMP := node_modules/.installed
CHROMIUM  ?= /usr/bin/chromium
PORT   ?= 8000
# pytest workers; --dist loadscope keeps each notebook's cells on one worker (tests/conftest.py
# spreads the grader's module test by test)
WORKERS ?= 2

.PHONY: install lock book book-check browser test serve gpu bench clean student grade autograder

install: $(STAMP)

# requirements.txt holds the ranges a reader may install into an environment of their own;
# requirements.lock pins the exact versions the suite was last tested with, as constraints.
$(STAMP): requirements.txt requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt -c requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

# Re-resolve requirements.lock from requirements.txt with a real resolver (pip-tools).
# torch's local label (+cpu) is dropped: `torch==X` admits the CPU build where pip's
# find-links offers it and PyPI's build elsewhere (PEP 440 ignores local labels in ==).
lock: $(STAMP)
	$(BIN)/python -m pip install -q pip-tools
	$(BIN)/pip-compile -q --no-header --strip-extras --allow-unsafe --no-emit-index-url \
	  --no-emit-find-links -o requirements.lock.new requirements.txt
	{ echo "# The versions make install (so make test and CI) installs: requirements.txt's ranges,"; \
	  echo "# resolved by pip-compile on the CPU machines. Refresh with make lock; see the Makefile."; \
	  sed -E 's/^(torch==[^+ ]+)\+[a-z0-9.]+/\1/' requirements.lock.new; } > requirements.lock
	rm requirements.lock.new

$(NPM_STAMP): package.json package-lock.json
	npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

# The cache knows a notebook by its code cells alone, but what a page shows also depends on
# labkit and on the recorded GPU results: a change to either (a new `make gpu`, a pull)
# empties the cache and removes Sphinx's saved environment (kept, it makes Sphinx re-read
# only the sources that changed, and the other pages show what they showed before), so no
# page keeps figures from before it.
CACHE_STAMP  := _build/.cache-inputs
CACHE_INPUTS := $(shell find src/labkit book/results -type f -not -path '*/__pycache__/*' 2>/dev/null)
$(CACHE_STAMP): $(CACHE_INPUTS)
	rm -rf _build/.jupyter_cache _build/.doctrees
	mkdir -p _build
	touch $@

# Executes notebooks through Jupyter Book's cache (_build/.jupyter_cache): a rebuild
# re-executes only the notebooks whose code changed. Any warning fails the build.
book: $(STAMP) $(NPM_STAMP) $(CACHE_STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going

# The whole built site in a browser: every page of _build/html, every chapter checked in
# full (make test checks a build of the site that executes a representative subset).
# Screenshots land in _build/site-screenshots/.
book-check: book browser
	LABKIT_SITE=_build/html $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_site.py

# Debian's Chromium for tests/test_site.py. Where apt-get cannot run as root the test
# skips and says why (it never skips on CI).
browser:
	@test -x $(CHROMIUM) || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "no apt-get as root: cannot install $(CHROMIUM); the browser test will skip"; fi; }

# LABKIT_COMPILE_CHECK=1: on a machine without a GPU, every kernel the interpreter runs is
# also compiled for the H200 (sm_90) and checked against its limits (labkit.compile_check).
# The run starts by printing what is installed (pinned by requirements.lock) and ends with
# each notebook's wall time and the slowest tests (tests/conftest.py caps torch's threads per
# worker, so the workers and their notebook kernels never oversubscribe the cores).
test: $(STAMP) $(NPM_STAMP) browser
	@echo "== installed (make install pins these with requirements.lock) =="
	@$(BIN)/python -m pip list --format=freeze --exclude-editable | paste -sd ' ' | fold -s -w 100
	LABKIT_COMPILE_CHECK=1 $(BIN)/python -m pytest -n $(WORKERS) --dist loadscope tests chapters book \
	  --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider --durations=15

serve:
	@test -d _build/html || { echo "no site yet: run 'make book' first"; exit 1; }
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory _build/html $(PORT)

# On a CUDA machine: execute chapters with real sizes and record their measurements.
#   make gpu            every chapter        make gpu SELECT=1    part I only
gpu: $(STAMP)
	$(BIN)/python -m labkit.record $(SELECT)

# The benchmarks from the terminal: ratio tables against references and ceilings.
bench: $(STAMP)
	$(BIN)/python -m labkit.bench $(SELECT)

# Exercises (book/instructors.md): student versions, grading, Gradescope autograders.
#   make student [EX=<id>]              into _build/student/<id>/ (all exercises without EX)
#   make grade EX=<id> SUB=<file>       grade a notebook or .py you trust (local mode); writes _build/grade/<id>/results.json
#   make autograder [EX=<id>]           Gradescope zips into _build/autograder/
student: $(STAMP)
	$(BIN)/python -m labkit.grade student $(EX)

grade: $(STAMP)
	@test -n "$(EX)" -a -n "$(SUB)" || { echo "usage: make grade EX=<exercise-id> SUB=<notebook.ipynb|submission.py>"; exit 2; }
	$(BIN)/python -m labkit.grade grade $(EX) $(SUB) --out _build/grade/$(EX)/results.json --trust-submission

autograder: $(STAMP)
	$(BIN)/python -m labkit.grade autograder $(EX)

clean:
	rm -rf _build .jupyter_cache
