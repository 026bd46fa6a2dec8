"""What TorchTitan 0.3.0 asks of torch that torch 2.13 lacks, provided explicitly by NVFP4Trainer (never on import).

TorchTitan 0.3.0's Trainer lowers every process group's timeout after the first training step with
``torch.distributed.set_timeout``, which torch 2.13 does not have: there every 0.3 run, BF16 included, stops with
an AttributeError after step 1. torch 2.13 has the same operation as ``distributed_c10d._set_pg_timeout``.
"""

import torch.distributed as dist
from torchtitan.tools.logging import logger


def provide_set_timeout() -> bool:
    """Give torch.distributed its ``set_timeout(timeout, group=None)`` where it is missing; True if it was."""
    if hasattr(dist, "set_timeout"):
        return False
    from torch.distributed.distributed_c10d import _set_pg_timeout

    dist.set_timeout = _set_pg_timeout
    logger.info("NVFP4: torch.distributed.set_timeout (which TorchTitan 0.3's Trainer calls after step 1) is missing "
                "from this torch; using torch.distributed.distributed_c10d._set_pg_timeout")
    return True
