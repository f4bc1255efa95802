"""Units whose forward does not run in a step: workaround 29 of :mod:`lightning_fairscale.fsdp.patches.workarounds`.

Real models leave layers out of a step all the time: a head used in one stage only (``predict_step``), deep
supervision on some steps, a mixture-of-experts layer whose expert gets no tokens, a pooler a fine-tuning task
ignores. Unsharded (and under DDP's ``find_unused_parameters=True``) such a layer's parameters get no gradient: an
optimizer skips them, their values and their optimizer state stay as they were. FairScale ends every backward
(``_wait_for_post_backward``, on the root) as if every unit had run in it: it frees each unit's full parameters
(which a unit whose forward never ran has not even set up: ``AttributeError: 'FlatParameter' object has no
attribute '_full_param_padded'``) and asserts that each unit's post-backward hook fired.

:func:`before_end_of_backward` runs just before it and settles the units that the backward did not reach (still
``IDLE``: no forward, or a forward whose output the loss did not use): their flat parameters' attributes are set up
(as FairScale's first forward would), their state is the one FairScale's end of the backward expects, and their
gradient is left as it is (``None`` after ``zero_grad()``: no update, no change of the optimizer's state). One case
needs a collective: a unit that ran in the accumulating backward passes (``no_sync``) but not in the synchronising
one holds the unsharded sum of its earlier passes' gradients, which FairScale reduce-scatters only from a hook that
no longer fires; it is reduce-scattered here, as its hook would have (DDP reduces such gradients too). Every rank
decides alike as long as every rank runs the same units, which :mod:`~lightning_fairscale.fsdp.unit.rank_agreement`
checks.
"""

from __future__ import annotations


from fairscale.nn.data_parallel.fully_sharded_data_parallel import TrainingState

from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from lightning_fairscale.fsdp.unit.instances import fsdp_instances

__all__ = ["before_end_of_backward"]


def before_end_of_backward(root: _FairScaleFSDP) -> None:
    """Before FairScale's end of a backward on ``root``: settle the units of ``root`` that the backward did not reach
    (see the module's docstring)."""
    for unit in fsdp_instances(root):
        if unit is root or unit.training_state != TrainingState.IDLE:
            continue
        for param in unit.params:  # a no-op for a unit whose forward ran once
            unit._init_param_attributes(param)
        if root._require_backward_grad_sync:
            accumulated = [p for p in unit.params if p.grad is not None and p.grad.size() == p._orig_size]
            if accumulated:  # also on one rank of a shard group: hybrid sharding averages it over the replicas
                unit.training_state = TrainingState.BACKWARD_PRE
                for param in accumulated:
                    unit._post_backward_hook(param)
        # What FairScale's end of the backward asserts of a unit it reached: BACKWARD_POST when it has trainable flat
        # parameters, BACKWARD_PRE when they are all frozen; a unit holding none (nor its children) may stay IDLE.
        if any(p.requires_grad for p in unit.parameters()):
            trainable = any(p.requires_grad for p in unit.params)
            unit.training_state = TrainingState.BACKWARD_POST if trainable else TrainingState.BACKWARD_PRE
