# Thin wrappers over the README commands; scripts/install.sh does the real work.
.PHONY: install test quickstart

install:
	bash scripts/install.sh --vllm

test:
	.venv/bin/python -m pytest

quickstart:
	.venv/bin/hybridflow train configs/quickstart_cpu.yaml
