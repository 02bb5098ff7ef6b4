r"""The multi-node example's training script: recipes/qwen_math.py, with this rank's vLLM server picked for it.

    VLLM_SERVER_URLS=http://gen0:8000,http://gen0:8002,... accelerate launch --config_file ... multinode_grpo.py \
        --config recipes/accelerate_configs/multinode_recipe.yaml

Every training rank has its own generation process; with `use_vllm=True, vllm_mode="server"` that process generates
through one vLLM server and pushes the weights to it (LoRA: the adapter only, under a name of its own). TRL's
`vllm_server_base_url` is one URL for all ranks, so this script gives rank r the server `VLLM_SERVER_URLS[r % M]`.
See recipes/accelerate_configs/README.md ("Multi-node") for when ranks may share a server.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from qwen_math import main as recipe_main  # noqa: E402


def server_for_rank(urls: str, rank: int) -> str:
    servers = [url.strip() for url in urls.split(",") if url.strip()]
    if not servers:
        raise ValueError("VLLM_SERVER_URLS is empty: give the vLLM servers' URLs, comma-separated.")
    return servers[rank % len(servers)]


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # what this script adds, then the recipe's options; no servers needed
        print(__doc__)
        recipe_main(sys.argv[1:])
    urls = os.environ.get("VLLM_SERVER_URLS")
    if urls is None:
        raise SystemExit("Set VLLM_SERVER_URLS to the vLLM servers' URLs, comma-separated (see the README).")
    rank = int(os.environ.get("RANK", "0"))  # the global rank, set by accelerate launch / torchrun on every node
    recipe_main([*sys.argv[1:], "--vllm_server_base_url", server_for_rank(urls, rank)])
