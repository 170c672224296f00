"""The one use of peft internals: keep gptqmodel unimported when the model has no GPTQ layers.

peft 0.21.2's LoRA dispatch (``peft.tuners.lora.gptq.dispatch_gptq``, ``...awq``, ``peft.utils.other``) imports
gptqmodel for every layer whenever gptqmodel is installed (``peft.import_utils.is_gptqmodel_available``). Importing
gptqmodel prints its banner and "Auto setting PYTORCH_ALLOC_CONF / CUDA_DEVICE_ORDER" lines and sets those
variables, in every LoRA run and merge of a 16-bit model, where no GPTQ layer can exist. Checked against
peft 0.21.2 (the modules below each bind ``is_gptqmodel_available`` by name) and gptqmodel 7.6.0.
"""
from __future__ import annotations

import contextlib
import importlib

# peft modules that bind is_gptqmodel_available by name (peft 0.21.2)
_PEFT_MODULES = ("peft.tuners.lora.gptq", "peft.tuners.lora.awq", "peft.utils.other", "peft.utils.quantization_utils")


@contextlib.contextmanager
def without_gptqmodel(active: bool = True):
    """Within the block, peft sees gptqmodel as not installed (``active`` False: no change). Use it only around
    peft calls on a model without GPTQ layers. A peft without one of these modules or names is left as it is."""
    saved = []
    if active:
        for name in _PEFT_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(mod, "is_gptqmodel_available"):
                saved.append((mod, mod.is_gptqmodel_available))
                mod.is_gptqmodel_available = lambda: False
    try:
        yield
    finally:
        for mod, fn in saved:
            mod.is_gptqmodel_available = fn
