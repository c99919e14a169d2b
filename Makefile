# parallel-from-scratch: `make test` and `make run-N` work from a clean clone.
# PY=python3 skips the venv and uses that interpreter as it is (e.g. a GPU box's system torch).

VENV    ?= .venv
PY      ?= $(VENV)/bin/python
ARGS    ?=
# Empty NPROC means: the GPU count, else the chapter's CPU default (4; 8 for chapter 07).
NPROC   ?=
export OMP_NUM_THREADS ?= 1

ifeq ($(PY),$(VENV)/bin/python)
SETUP := $(VENV)/.installed
else
SETUP :=
endif

CHAPTERS := 1 2 3 4 5 6 7
RUNS     := $(addprefix run-,$(CHAPTERS))
BENCHES  := $(addprefix bench-,$(CHAPTERS))
TESTS    := $(addprefix test-,$(CHAPTERS) common checkpoints notebooks labs benches moe)
.PHONY: figures figures-check lab-check setup test test-fast test-thorough $(TESTS) lint notebooks lab bench bench-5-cp bench-5-ep run-5-ep gpu-check clean help $(RUNS) $(BENCHES)

help:
	@echo "make test            create .venv, install, run the equivalence suite (CI runs this)"
	@echo "make run-N           launch chapter N with torchrun (NPROC=…, ARGS=\"--steps 50 …\")"
	@echo "make run-5-ep        chapter 5's MoE demo: expert parallelism (05_tensor_parallel/train_expert.py)"
	@echo "make bench-N         chapter N's benchmark against torch's built-in equivalent"
	@echo "make bench-5-cp      context parallelism: ring attention vs the all-gather variant"
	@echo "make bench-5-ep      expert parallelism: all-to-all vs an all-gather baseline vs replicated experts"
	@echo "make test-fast N=5   a contributor's minutes: one example of every property of chapter 5"
	@echo "                     (N = 1..7, common, checkpoints, labs, moe; no notebooks or launches; no N: all)"
	@echo "make test-N          one chapter's tests (N = 1..7, common, checkpoints, notebooks, labs, benches, moe)"
	@echo "make test-thorough   the suite with many hypothesis examples"
	@echo "make notebooks       execute every lesson.ipynb in place"
	@echo "make figures         redraw every lesson figure from the code it pictures (each chapter's figures/)"
	@echo "make figures-check   write nothing; exit 1 if an image is missing or older than its data"
	@echo "make lab-check N=1   grade your lab (0N_*/lab.py) against one device; SOLUTION=1 grades the reference"
	@echo "                     (N=5 LAB=expert: expert parallelism's lab; N=5 LAB=context: ring attention's)"
	@echo "make lab             install JupyterLab into the venv (the 'lab' extra) and open the lessons"
	@echo "make lint            ruff check"
	@echo "make gpu-check       every chapter on NCCL + a bf16 throughput/MFU benchmark (CUDA only)"

setup: $(SETUP)

# Re-install only when the dependency files change.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $@

# --durations=15: the slowest tests, so that a regression shows; the ci profile (default) also
# prints each chapter's seconds against its budget (tests/conftest.py).
test: $(SETUP)
	$(PY) -m pytest -q --durations=15

# N=<chapter> keeps that chapter's test files (tests/conftest.py BUDGET_S); the fast profile runs
# one example of every property, so every property of the chapter still runs once.
test-fast: $(SETUP)
	HYPOTHESIS_PROFILE=fast $(if $(N),PFS_CHAPTER=$(N)) $(PY) -m pytest -q -x -m "not slow" --durations=10

$(TESTS): test-%: $(SETUP)
	PFS_CHAPTER=$* $(PY) -m pytest -q --durations=10

test-thorough: $(SETUP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q --durations=15

lint: $(SETUP)
	$(PY) -m ruff check .

notebooks: $(SETUP)
	$(PY) -m common.notebooks --in-place

figures: $(SETUP)
	$(PY) -m common.figures $(ARGS)

figures-check: $(SETUP)
	$(PY) -m common.figures --check

# The labs: you write a chapter's mechanism in 0N_*/lab.py (or a chapter's other lab, LAB=name:
# lab_<name>.py); the grader runs its properties on your file and prints a verdict per property
# (common/labs/grader.py); the exit status is 1 when any verdict fails the lab.
N ?=
LAB ?=
ONLY ?=
lab-check: $(SETUP)
	@test -n "$(N)" || { echo "usage: make lab-check N=<chapter 1-7> [LAB=expert|context] [SOLUTION=1] [FILE=path] [ONLY=words]"; exit 2; }
	$(PY) -m common.labs.grader $(N) $(if $(LAB),--lab $(LAB)) $(if $(SOLUTION),--solution) $(if $(FILE),--file $(FILE)) $(if $(ONLY),--only "$(ONLY)")

# JupyterLab is not part of `make test`'s install: the optional extra `lab`, installed on first use.
LAB_URL ?= /lab/tree/01_data_parallel/lesson.ipynb
lab: $(VENV)/.lab-installed
	$(PY) -m jupyterlab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=$(LAB_URL) \
	    $(if $(filter 0,$(shell id -u)),--allow-root)

$(VENV)/.lab-installed: pyproject.toml constraints.txt | $(SETUP)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev,lab]'
	touch $@

# run-N: chapter N's train.py under torchrun on NPROC ranks (NCCL on GPUs, gloo on CPU processes).
$(RUNS): run-%: $(SETUP)
	@dir=$$(ls -d 0$*_*/ | head -1); test -f "$$dir/train.py" || { echo "chapter $* has no train.py yet"; exit 2; }; \
	n="$(NPROC)"; [ -n "$$n" ] || n=$$($(PY) -m common.dist --nproc $*); \
	echo "torchrun --standalone --nproc-per-node $$n $${dir}train.py $(ARGS)"; \
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $$n $${dir}train.py $(ARGS)

# run-5-ep: chapter 5's second demo, a mixture-of-experts model under expert parallelism (and TP).
run-5-ep: $(SETUP)
	@n="$(NPROC)"; [ -n "$$n" ] || n=$$($(PY) -m common.dist --nproc 5); \
	echo "torchrun --standalone --nproc-per-node $$n 05_tensor_parallel/train_expert.py $(ARGS)"; \
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $$n 05_tensor_parallel/train_expert.py $(ARGS)

$(BENCHES): bench-%: $(SETUP)
	@dir=$$(ls -d 0$*_*/ | head -1); test -f "$$dir/bench.py" || { echo "chapter $* has no bench.py yet"; exit 2; }; \
	n="$(NPROC)"; [ -n "$$n" ] || n=$$($(PY) -m common.dist --nproc $*); \
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $$n $${dir}bench.py $(ARGS)

bench: $(SETUP)
	@for d in 0*_*/; do n=$${d%%_*}; n=$${n#0}; \
	  if [ -f "$$d/bench.py" ]; then $(MAKE) --no-print-directory bench-$$n PY=$(PY) || exit 1; fi; done
	@$(MAKE) --no-print-directory bench-5-cp PY=$(PY)
	@$(MAKE) --no-print-directory bench-5-ep PY=$(PY)

bench-5-cp: $(SETUP)
	@n="$(NPROC)"; [ -n "$$n" ] || n=$$($(PY) -m common.dist --nproc 5); \
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $$n 05_tensor_parallel/bench_context_parallel.py $(ARGS)

bench-5-ep: $(SETUP)
	@n="$(NPROC)"; [ -n "$$n" ] || n=$$($(PY) -m common.dist --nproc 5); \
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $$n 05_tensor_parallel/bench_expert_parallel.py $(ARGS)

gpu-check: $(SETUP)
	$(PY) -m common.gpu_check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
