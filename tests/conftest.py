"""Builders and fixtures of the second tier's tests that need the package (harness/) besides
dflash2.py; those that need dflash2.py alone are the top conftest.py's, which the card's tests
read too. tests/ is a package so that this conftest and the top one are two modules."""
import torch

from dflash2 import DFlash2Drafter
from harness.target import drafter_config, rope_tables


def tiny_drafter(target, seed=1, dtype=torch.float64, **overrides):
    """A random drafter for `target` (1 layer, mask token V - 1 unless overridden) whose DFlash2
    parts are off their identity init: the selector's codebooks and projection are random (so
    q depends on the predecessor) and the convolution has nonzero off-centre taps and dynamic
    kernels. A rope_scaling override takes its tables from harness.target.rope_tables."""
    torch.manual_seed(seed)
    shape = dict(mask_token_id=target.config.vocab_size - 1, num_layers=1, conv_group_size=8, selector_rank=4)
    c = drafter_config(target.config, **{**shape, **overrides})
    drafter = DFlash2Drafter(c, rope=rope_tables(c))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("candidate_selector."):
                p.normal_(0, 1.5)
            elif "_conv." in name:
                p.add_(0.3 * torch.randn_like(p))
    return drafter.to(dtype).eval()
