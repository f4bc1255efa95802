"""What the FairScale strategies need from a precision setting, for the Trainer's plugins and for Fabric's.

The Trainer's precision plugins (:mod:`lightning_fairscale.precision`) and the Fabric strategies' handling of Fabric's
plugins (:mod:`lightning_fairscale.fabric._common`) are built on these: which precisions are supported, the dtype
FSDP computes in (and, under true half precision, holds everything in), and a grad scaler whose inf/NaN checks agree
across ranks. Nothing here depends on Lightning.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning_utilities.core.rank_zero import rank_zero_deprecation


__all__ = [
    "SUPPORTED_PRECISION",
    "compute_dtype",
    "half_dtype",
    "mixed_precision_name",
    "true_half_dtype",
    "unsupported",
]

#: The precision settings both strategies support: FP32; mixed precision (FP32 parameters or master shards,
#: computing in fp16 or bf16); true half precision (parameters, gradients and optimizer state in fp16 or bf16).
SUPPORTED_PRECISION = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


#: Lightning 1.x's values of ``precision`` for mixed precision (``16`` or ``"16"``, and ``"bf16"``), and their names
#: since Lightning 2.
LEGACY_MIXED_PRECISION = {"16": "16-mixed", "bf16": "bf16-mixed"}


def mixed_precision_name(precision: Any, owner: str) -> Any:
    """Lightning 2's name of a Lightning 1.x mixed-precision value, for the constructors of the mixed-precision
    plugins, with a deprecation warning that names it; any other value as it is (the plugin judges it).

    Code written for Lightning 1.x or the original extension builds them as ``ShardedNativeMixedPrecisionPlugin(16,
    "cuda")``; Lightning 2's ``MixedPrecision`` refuses ``16``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     name = mixed_precision_name(16, "Plugin")
        >>> name, str(caught[0].message)
        ('16-mixed', "`Plugin(precision=16)` is deprecated (Lightning 1.x's value): use precision='16-mixed'.")
        >>> mixed_precision_name("bf16-mixed", "Plugin")
        'bf16-mixed'
    """
    legacy = str(precision) if isinstance(precision, (int, str)) and not isinstance(precision, bool) else None
    if legacy not in LEGACY_MIXED_PRECISION:
        return precision
    name = LEGACY_MIXED_PRECISION[legacy]
    # Pointing at the line that called the plugin's constructor, past this function and the constructor (see
    # `lightning_fairscale._deprecated` for the frames of `rank_zero_deprecation`).
    rank_zero_deprecation(
        f"`{owner}(precision={precision!r})` is deprecated (Lightning 1.x's value): use precision={name!r}.",
        stacklevel=7,
    )
    return name


def compute_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype mixed precision computes in: ``None`` for full precision.

    Example:
        >>> compute_dtype("bf16-mixed"), compute_dtype("16-mixed"), compute_dtype("32-true")
        (torch.bfloat16, torch.float16, None)
    """
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def half_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype true half precision holds parameters, gradients and optimizer state in: ``None`` for the others.

    Example:
        >>> half_dtype("bf16-true"), half_dtype("16-true"), half_dtype("bf16-mixed")
        (torch.bfloat16, torch.float16, None)
    """
    return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision)


def unsupported(strategy: str, plugin: Any, how: str, own: Optional[str] = None) -> ValueError:
    """The error for a precision plugin that ``strategy`` cannot train with; ``how`` says where to set another.

    ``own`` names the strategy's own plugin classes: a plugin of another class for a supported precision is refused
    for its class, not its precision.

    Example:
        >>> str(unsupported("DDPShardedStrategy", "16-true", "`Fabric(precision=...)`")).split(". ")[0]
        "`DDPShardedStrategy` does not support precision='16-true'"
    """
    precision = plugin if isinstance(plugin, str) else getattr(plugin, "precision", type(plugin).__name__)
    if own is not None and precision in SUPPORTED_PRECISION:
        return ValueError(
            f"`{strategy}` cannot use the precision plugin {type(plugin).__name__} (precision={precision!r}): only its"
            " own plugins clip gradients by the norm of all shards and scale fp16 losses with checks that agree across"
            f" ranks. Pass {how} without this plugin, or make your plugin a subclass of {own}."
        )
    return ValueError(
        f"`{strategy}` does not support precision={precision!r}. Use one of"
        f" {', '.join(repr(p) for p in SUPPORTED_PRECISION)} ({how}): FP32, mixed precision (FP32 parameters,"
        " computing in fp16 or bf16) or true half precision (everything in fp16 or bf16)."
    )


def true_half_dtype(mixed_precision: bool, compute_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype an FSDP unit holds its parameters, gradients and computations in under true half precision
    (workaround 13 of :mod:`lightning_fairscale.fsdp.patches.workarounds`): its ``compute_dtype`` when that is fp16 or
    bf16 without mixed precision; ``None`` for any other unit.

    Example:
        >>> true_half_dtype(False, torch.bfloat16), true_half_dtype(True, torch.bfloat16)
        (torch.bfloat16, None)
    """
    return compute_dtype if not mixed_precision and compute_dtype in (torch.float16, torch.bfloat16) else None
