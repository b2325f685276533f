# ML Systems Lab. The two commands a new reader needs:
#   make book    build the website into _build/html (executes the notebooks)
#   make test    run the whole test suite
# Both create .venv and install requirements.txt and labkit (editable) on first use.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 8000
# pytest workers; --dist loadscope keeps each notebook's cells on one worker
WORKERS ?= 2

.PHONY: install book test serve gpu bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going

test: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadscope tests chapters book \
	  --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider

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

clean:
	rm -rf _build .jupyter_cache
