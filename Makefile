# Two commands on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned in the CPU install path: 2.13.0 is the CPU wheel; an unpinned torch pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
# The DeepSpeed the slow tests were verified with (an sdist; its ops build just in time, not here).
DEEPSPEED_SPEC ?= deepspeed==0.19.0
PYTEST_ARGS ?=
# The real SGLang runtime on CPU for `make test-sglang` (tools/sglang-cpu/README.md): sglang goes in
# without its declared dependencies (they pin a CUDA torch and CUDA kernels), the router is the Rust
# gateway that fits it.
SGLANG_VENV ?= .venv-sglang
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_ROUTER_SPEC ?= sglang-router==0.3.2
SGLANG_CPU := tools/sglang-cpu

.PHONY: setup demo test test-slow test-gpu gpu-check test-sglang sglang-cpu test-ui lint bench clean mutants

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

# The deepspeed extra for the slow tests, with the pinned torch on the same command line so the
# resolver keeps the CPU wheel instead of pulling a CUDA torch.
$(VENV)/.deepspeed-installed: $(VENV)/.installed
	DS_BUILD_OPS=0 $(PIP) install -q "$(TORCH_SPEC)" "$(DEEPSPEED_SPEC)" -e '.[dev,deepspeed]'
	touch $@

# A second venv, so the default one stays free of SGLang's 2 GB. The CPU test shims (a placeholder
# sgl_kernel and a torchvision import hook) are copied into its site-packages.
$(SGLANG_VENV)/.installed: pyproject.toml $(SGLANG_CPU)/install_shims.py $(wildcard $(SGLANG_CPU)/*.txt $(SGLANG_CPU)/site/*.py $(SGLANG_CPU)/site/*/*.py)
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/pip install -q -c $(SGLANG_CPU)/constraints.txt "$(TORCH_SPEC)" \
		-r $(SGLANG_CPU)/requirements.txt "$(SGLANG_ROUTER_SPEC)" -e '.[dev]'
	$(SGLANG_VENV)/bin/pip install -q --no-deps "$(SGLANG_SPEC)"
	$(SGLANG_VENV)/bin/python $(SGLANG_CPU)/install_shims.py
	touch $@

sglang-cpu: $(SGLANG_VENV)/.installed

demo: setup
	$(VENV)/bin/cleaner demo

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: setup $(VENV)/.deepspeed-installed
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The real SGLang engine, servers and router on CPU (the `sglang` marker): one engine per session.
test-sglang: sglang-cpu
	OMP_NUM_THREADS=1 $(SGLANG_VENV)/bin/python -m pytest -q -m sglang $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# The train step at 16k and 32k tokens on a Qwen3-0.6B-shaped model, on a lent GPU, under 8 minutes,
# float16 (the paper's dtype) against float32 with a forced overflow and a resumed scale, then a
# co-located collect -> train -> collect where sglang is installed, and a LoRA step beside the full one
# where peft is (skipped, saying so, where it is not). It builds no venv: the
# device image's python has torch with CUDA, transformers and pyarrow, which is all the train probes
# need (bench/gpu_check.py finds cleaner in this checkout itself). Results in $(OUT) (or
# runs/gpu-check): gpu_check.md and .json, gpu_colocated.md and .json.
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py

# Mutation testing (tools/mutants.py, mutmut from the dev extra) of the modules that decide what is
# trained and stored, each mutant against the tests of its area that run its function (not the
# suite); docs/mutants.md lists the survivors, each killed or equivalent, and which batches have run.
# The modules come in batches, each run on its own (its scratch directory build/mutants/BATCH/, its
# report build/mutants-BATCH.json, its tests and its timeout): `make mutants` runs every batch, two
# mutants at a time on 2 cores (hours: about 1.5 for `train` alone); one batch:
# make mutants MUTANTS_BATCH=model. A mutant whose tests run past (their clean time + the batch's
# second MUTANTS_TIMEOUT_ figure, in seconds) x its first is a timeout: 4x because calls.py's mutants
# that lose a call's wake-up hang (mutmut's own 15x would wait minutes); 15 s where the tests build a
# tiny model in their fixtures, which the clean time leaves out.
# Another module: make mutants MUTANTS_MODULES=cleaner/x.py MUTANTS_TESTS=tests/test_x.py
MUTANTS_BATCHES := train model saar purify purify-job export parts store
MUTANTS_MODULES_train := cleaner/engine/train/rollout_correction.py cleaner/engine/train/optim.py \
	cleaner/engine/train/loss.py cleaner/engine/train/aggregation.py cleaner/engine/purify/advantages.py \
	cleaner/tools/calls.py
MUTANTS_EDGES := $(addprefix tests/engine/collect/test_edges.py::test_,a_tools_timeout_measures_its_run_never_its_wait_for_a_thread \
	a_call_past_its_timeout_times_out_at_any_concurrency hung_calls_give_up_their_threads_and_past_the_cap_stop_the_collection \
	a_hung_call_never_holds_up_the_exit a_coroutine_tool_that_blocks_its_loop_delays_only_its_own_calls \
	a_call_whose_loop_answers_between_its_neighbours_blocks_is_never_given_up \
	a_loop_blocked_for_good_gives_its_calls_up_as_hung_and_leaves_the_others open_and_close_are_bounded \
	a_toolbox_that_fails_to_open_stops_the_loops_it_started a_tools_service_fault_is_tried_again_then_infra_error_never_trained)
MUTANTS_TESTS_train := tests/engine/train/test_rollout_correction.py tests/engine/train/test_trainer.py \
	tests/engine/train/test_loss.py tests/engine/train/test_optim.py tests/engine/train/test_deepspeed_config.py \
	tests/engine/train/test_train_step.py::test_a_float16_iteration_equals_float32_within_its_rounding_and_a_nonfinite_step_is_skipped \
	tests/engine/train/test_aggregation.py tests/engine/train/test_objectives.py::test_the_objectives_on_one_batch_equal_verls \
	tests/engine/purify/test_advantages.py \
	tests/tools/test_calls.py tests/tools/test_toolbox.py tests/engine/grading/test_runner.py $(MUTANTS_EDGES)
MUTANTS_TIMEOUT_train := 4 1
MUTANTS_MODULES_model := cleaner/engine/model/answers.py cleaner/engine/model/trie_scorer.py cleaner/engine/model/radix.py \
	cleaner/engine/train/packing.py
MUTANTS_TESTS_model := tests/engine/model/test_answers.py tests/engine/model/test_sglang_wire.py \
	tests/engine/model/test_torch_backend.py::test_a_forward_that_overflows_into_nan_is_a_bad_answer_never_a_generation \
	tests/engine/model/test_trie_scorer.py tests/engine/model/test_backend_scorer.py tests/engine/train/test_train_step.py \
	tests/engine/train/test_packing.py
MUTANTS_TIMEOUT_model := 4 15
MUTANTS_MODULES_saar := $(wildcard cleaner/engine/saar/*.py)
MUTANTS_TESTS_saar := tests/engine/saar
MUTANTS_TIMEOUT_saar := 4 15
MUTANTS_MODULES_purify := cleaner/engine/purify/pipeline.py cleaner/engine/purify/negatives.py \
	cleaner/engine/purify/selection.py
MUTANTS_TESTS_purify := tests/engine/purify tests/engine/test_jobs.py
MUTANTS_TIMEOUT_purify := 4 15
# job.py over its hand-built warehouse and fake backend (a second a mutant; test_jobs.py builds a collection)
MUTANTS_MODULES_purify-job := cleaner/engine/purify/job.py
MUTANTS_TESTS_purify-job := tests/engine/purify/test_job.py \
	$(addprefix tests/engine/test_jobs.py::test_,cyclic_gc_is_paused_inside_and_restored_after_an_error \
	a_collector_disabled_by_the_caller_stays_disabled)
MUTANTS_TIMEOUT_purify-job := 4 15
MUTANTS_MODULES_export := $(wildcard cleaner/engine/export/*.py)
MUTANTS_TESTS_export := tests/engine/export/test_conversation.py tests/engine/export/test_rows_by_hand.py \
	tests/engine/export/test_export_job.py
MUTANTS_TIMEOUT_export := 4 15
# parts.py over its hand-built tests (a second a mutant); store.py over the warehouse's (minutes).
MUTANTS_MODULES_parts := cleaner/warehouse/parts.py
MUTANTS_TESTS_parts := tests/warehouse/test_parts.py
MUTANTS_TIMEOUT_parts := 4 15
MUTANTS_MODULES_store := cleaner/warehouse/store.py
MUTANTS_TESTS_store := tests/warehouse tests/test_full_disk.py
MUTANTS_TIMEOUT_store := 4 15
# Under mutmut's trampolines this byte-flip search runs past any timeout in the stats run (10 s
# plain); its after-a-read twin and the other checksum tests stay in.
MUTANTS_DESELECT_store := tests/warehouse/test_checksums.py::test_a_flipped_logprob_byte_is_named_by_sql_and_purify[before-any-read]
ifdef MUTANTS_MODULES
MUTANTS_BATCH := one
MUTANTS_MODULES_one := $(MUTANTS_MODULES)
MUTANTS_TESTS_one := $(MUTANTS_TESTS)
MUTANTS_TIMEOUT_one := $(or $(MUTANTS_TIMEOUT),4 1)
endif
MUTANTS_BATCH ?= $(MUTANTS_BATCHES)
MUTANTS_JOBS ?= 2
mutants_batch = OMP_NUM_THREADS=1 $(PY) tools/mutants.py --name $(1) --jobs $(MUTANTS_JOBS) \
	--timeout-multiplier $(word 1,$(MUTANTS_TIMEOUT_$(1))) --timeout-constant $(or $(word 2,$(MUTANTS_TIMEOUT_$(1))),1) \
	$(foreach m,$(MUTANTS_MODULES_$(1)),--module $(m)) $(foreach t,$(MUTANTS_TESTS_$(1)),--tests $(t)) \
	$(foreach d,$(MUTANTS_DESELECT_$(1)),--deselect '$(d)')
mutants: setup
	$(foreach b,$(MUTANTS_BATCH),$(call mutants_batch,$(b)) && ) true

# The browser tests of `cleaner ui`: Debian's Chromium and its driver from apt (root, or sudo),
# selenium from pip (pointed at /usr/bin/chromedriver: no browser is downloaded at test time).
# CLEANER_UI_SCREENSHOTS=docs/figures refreshes the README's screenshot.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

$(VENV)/.ui-test-installed: $(VENV)/.installed
	$(PIP) install -q "$(TORCH_SPEC)" -e '.[ui-test]'
	touch $@

test-ui: setup $(VENV)/.ui-test-installed
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; \
	fi
	$(PY) -m pytest -q -m ui $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check cleaner tests bench tools

clean:
	rm -rf $(VENV) $(SGLANG_VENV) .pytest_cache .hypothesis
