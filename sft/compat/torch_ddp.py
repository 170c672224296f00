"""torch's DistributedDataParallel: parameters it must leave alone (checked against torch 2.13).

DDP has no public way to exclude parameters from its gradient all-reduce and its start-up broadcast; its own
docstring names ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` as "a workaround ... until
the API is finalized" (pytorch issue 43690).
"""
from __future__ import annotations

CHECKED_TORCH_VERSION = "2.13"


def ddp_ignore(module, names: list[str]) -> None:
    """Make DDP leave ``module``'s parameters ``names`` (qualified names in ``module``, the module DDP will wrap)
    alone: no broadcast from rank 0 at wrapping, no all-reduce of their gradients, no shape check across ranks.
    Call before the module is wrapped (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``,
    torch 2.13: sets ``module._ddp_params_and_buffers_to_ignore``)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(names))
