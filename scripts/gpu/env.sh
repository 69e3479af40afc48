# Sourced by the stage scripts and your commands on the GPU machine (dependencies live in /tmp/site).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false SPECDRAFT_CACHE=/tmp/cache PYTHONPATH=/tmp/site
