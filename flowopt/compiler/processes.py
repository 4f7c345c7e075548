"""Which of several launched processes this is, read from the launcher's environment.

``accelerate launch`` and ``torchrun`` start N copies of one program and set ``RANK`` and
``WORLD_SIZE`` in each. The compiler only needs to know them to let rank 0 alone write the run folder
(the weights stages join the process group themselves, in ``flowopt.optimizers.weights.distributed``).

Example:
    >>> launched_processes({"RANK": "1", "WORLD_SIZE": "2"})
    (1, 2)
    >>> launched_processes({})
    (0, 1)
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def launched_processes(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world size)`` of this process; ``(0, 1)`` when it was not launched as one of several."""
    env = os.environ if env is None else env
    return int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
