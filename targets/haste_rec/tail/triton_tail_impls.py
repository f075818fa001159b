"""The Triton implementation of each tail kernel slot, bound to one tile config.

It sits above every tail kernel module (``triton_tail``, ``triton_tail_backward``, ``triton_perlabel``), which
share ``triton_tail``'s config, helpers and checks: kept in ``triton_tail``, the registry made it import the
modules that import it.
"""

from __future__ import annotations

import functools
from typing import Callable

from targets.haste_rec.tail.triton_perlabel import perlabel_forward_triton
from targets.haste_rec.tail.triton_tail import (DEFAULT_CONFIG, TailKernelConfig, tail_backward_weight_triton,
                                                tail_forward_triton)
from targets.haste_rec.tail.triton_tail_backward import tail_backward_input_triton


def triton_tail_impls(config: TailKernelConfig = DEFAULT_CONFIG) -> dict[str, Callable]:
    """The Triton implementation of each tail kernel slot, bound to one tile config."""

    def bound(fn: Callable) -> Callable:  # keeps fn's name for profiles and reports
        return functools.update_wrapper(functools.partial(fn, config=config), fn)

    return {"tail_forward": bound(tail_forward_triton), "tail_backward_weight": bound(tail_backward_weight_triton),
            "tail_backward_input": bound(tail_backward_input_triton), "perlabel_forward": perlabel_forward_triton}
