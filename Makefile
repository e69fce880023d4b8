# Two entry points that work on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch>=2.6
# pytest-xdist workers for `make test`; a file's tests stay on one worker (module fixtures, one Slurm).
TEST_WORKERS ?= 2
RUN_ARGS ?=
BIN := $(VENV)/bin

.PHONY: run test test-torch lint pytest mutation venv venv-run clean

# The stamps depend on pyproject.toml so a changed dependency list reinstalls. Recipe lines are
# silent (@): a newcomer sees pip's own output, not the Makefile's comments.
# `make run`: torch first and alone, so TORCH_SPEC decides the version (tools/install-torch picks the
# build: CPU where there is no NVIDIA GPU), then fsdpkit with what training needs and nothing else.
$(VENV)/.installed-run: pyproject.toml Makefile
	@echo "setting up $(VENV): torch, then fsdpkit (training only)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@tools/install-torch $(BIN)/pip "$(TORCH_SPEC)"
	@$(BIN)/pip install -q -e .
	@touch $@

# `make test`: the test extras on top, and two of AWS's own packages the HyperPod tests read (the
# HyperPod CLI's API models of a HyperPodPyTorchJob, the elastic agent's log-monitoring evaluator)
# without their dependencies, which pin torch, pytest and ruff to old releases: the tests load only
# the modules that need none of them. VERL's own config checks for the GRPO recipe
# (tests/jobs/test_verl_recipe.py): VERL 0.5.0, the release VERL's verl0.5 images are built for, and
# what its config path imports, in a folder of their own (ray alone is 250 MB, and none of it
# belongs beside the suite's packages).
$(VENV)/.installed: $(VENV)/.installed-run
	@echo "adding the test extras to $(VENV)"
	@$(BIN)/pip install -q -e ".[test]"
	@$(BIN)/pip install -q --no-deps "sagemaker-hyperpod==3.12.0" "hyperpod-elastic-agent==1.1.3"
	@$(BIN)/pip install -q --no-deps --target $(VENV)/verl-check "verl==0.5.0" "ray==2.60.0" "tensordict==0.9.1" \
		"torchdata==0.11.0" "codetiming==1.4.0" "hydra-core==1.3.8" "omegaconf==2.3.1" \
		"antlr4-python3-runtime==4.9.3" "msgpack==1.2.4" "orjson==3.13.0" "pyvers==0.1.0"
	@touch $@

venv-run: $(VENV)/.installed-run

venv: $(VENV)/.installed

run: venv-run
	@$(BIN)/fsdpkit train $(RUN_ARGS)

test: lint pytest

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The suite starts some thousands of interpreters: each reads the compiled modules (and pytest's
# rewritten tests) the first wrote, where an environment that says not to write them would have each
# compile its own again. The workers take the files longest first, in the order the suite collects
# them (tests/worker_order.py), not xdist's by number of tests.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	--no-loadscope-reorder

pytest: venv
	$(PYTEST) $(PYTEST_ARGS)

# The tests that depend on torch (marked by tests/torch_pass.py): what CI runs again on the newest torch.
test-torch: venv
	$(PYTEST) -m torch $(PYTEST_ARGS)

# How many one-token changes to the modules that derive a job's numbers the tests catch, per module,
# into benchmarks/RESULTS.md (benchmarks/mutation.py; an hour or more on two cores, so not in `make test`).
mutation: venv
	$(BIN)/pip install -q -e ".[mutation]"
	$(BIN)/python -m benchmarks.mutation

clean:
	rm -rf $(VENV) runs
