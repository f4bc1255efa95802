"""Code written for the original extension or for Lightning 1.x's FairScale support imports unchanged: every module
path and public name of the original extension (Lightning-Universe/lightning-Fairscale, ``src/lightning_fairscale``
at its last commit, 6ebaf6f) and every FairScale name of Lightning 1.9.5 (``pytorch_lightning.strategies.sharded``,
``.sharded_spawn``, ``.fully_sharded``, ``pytorch_lightning.plugins[.precision][.sharded_native_amp,
.fully_sharded_native_amp]``, mapped onto the extension's layout) resolves to today's class; the names that changed
warn, naming the new one. The same holds in the ``lightning`` flavour (``lightning_fairscale.lightning.<...>``)."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from fairscale.optim.grad_scaler import ShardedGradScaler as FairScaleShardedGradScaler

from lightning_fairscale.mixed_precision.grad_scaler import ShardedGradScaler

#: Today's home of each class: (module, name).
FSDP = ("strategies.fully_sharded", "DDPFullyShardedStrategy")
SHARDED = ("strategies.sharded", "DDPShardedStrategy")
SPAWN = ("strategies.sharded", "DDPSpawnShardedStrategy")
FSDP_MIXED = ("precision.fully_sharded", "FullyShardedMixedPrecisionPlugin")
SHARDED_MIXED = ("precision.sharded", "ShardedMixedPrecisionPlugin")

#: The original extension's public API: (module, name) -> today's class. Its `overrides` module held private helpers
#: only (`_reinit_optimizers_with_oss`, `_FAIRSCALE_AVAILABLE`) and is not part of it.
EXTENSION = {
    ("strategies", "DDPFullyShardedStrategy"): FSDP,
    ("strategies", "DDPShardedStrategy"): SHARDED,
    ("strategies", "DDPSpawnShardedStrategy"): SPAWN,
    ("strategies.fully_sharded", "DDPFullyShardedStrategy"): FSDP,
    ("strategies.sharded", "DDPShardedStrategy"): SHARDED,
    ("strategies.sharded_spawn", "DDPSpawnShardedStrategy"): SPAWN,
    ("precision", "FullyShardedMixedPrecisionPlugin"): FSDP_MIXED,
    ("precision", "ShardedMixedPrecisionPlugin"): SHARDED_MIXED,
    ("precision.fully_sharded_amp", "FullyShardedMixedPrecisionPlugin"): FSDP_MIXED,
    ("precision.sharded_amp", "ShardedMixedPrecisionPlugin"): SHARDED_MIXED,
}

#: Lightning 1.9.5's names, where this package has them (``pytorch_lightning.strategies`` is ``strategies``,
#: ``pytorch_lightning.plugins`` the package itself, ``.plugins.precision`` is ``precision``, ``sharded_native_amp``
#: is ``sharded_amp`` as in the extension), that kept their name.
LIGHTNING_1X = {
    ("strategies", "DDPFullyShardedStrategy"): FSDP,
    ("strategies", "DDPShardedStrategy"): SHARDED,
    ("strategies", "DDPSpawnShardedStrategy"): SPAWN,
    ("strategies.fully_sharded", "DDPFullyShardedStrategy"): FSDP,
    ("strategies.sharded", "DDPShardedStrategy"): SHARDED,
    ("strategies.sharded_spawn", "DDPSpawnShardedStrategy"): SPAWN,
}

#: Lightning 1.9.5's names that changed: deprecated aliases.
RENAMED = {
    ("", "ShardedNativeMixedPrecisionPlugin"): SHARDED_MIXED,
    ("", "FullyShardedNativeMixedPrecisionPlugin"): FSDP_MIXED,
    ("precision", "ShardedNativeMixedPrecisionPlugin"): SHARDED_MIXED,
    ("precision", "FullyShardedNativeMixedPrecisionPlugin"): FSDP_MIXED,
    ("precision.sharded_amp", "ShardedNativeMixedPrecisionPlugin"): SHARDED_MIXED,
    ("precision.fully_sharded_amp", "FullyShardedNativeMixedPrecisionPlugin"): FSDP_MIXED,
}

FLAVOURS = ["lightning_fairscale", "lightning_fairscale.lightning"]


def _module(flavour: str, relative: str) -> Any:
    if flavour.endswith(".lightning"):
        pytest.importorskip("lightning")
    return importlib.import_module(f"{flavour}.{relative}" if relative else flavour)


def _todays(flavour: str, home: tuple[str, str]) -> type:
    """Today's class, from the module that defines it (and checked to be defined there, not re-made elsewhere)."""
    module, name = home
    cls = getattr(_module(flavour, module), name)
    assert cls.__module__ == f"{flavour}.{module}"
    return cls


def _no_deprecation(action: Any) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = action()
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)], [str(w.message) for w in caught]
    return value


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(("module", "name"), sorted(EXTENSION.keys() | LIGHTNING_1X.keys()))
def test_a_name_that_kept_its_name_is_todays_class_without_warning(flavour: str, module: str, name: str) -> None:
    home = EXTENSION.get((module, name)) or LIGHTNING_1X[module, name]
    value = _no_deprecation(lambda: getattr(_module(flavour, module), name))
    assert value is _todays(flavour, home)


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize(("module", "name"), sorted(RENAMED))
def test_a_renamed_1x_name_is_todays_class_and_warns_naming_the_new_one(flavour: str, module: str, name: str) -> None:
    namespace = _module(flavour, module)
    new = RENAMED[module, name][1]
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(namespace, name)
    assert value is _todays(flavour, RENAMED[module, name])
    (warning,) = caught
    where = namespace.__name__
    assert str(warning.message) == (
        f"`{where}.{name}` is Lightning 1.x's name of `{new}` and is deprecated. Use `from {where} import {new}`."
    )
    assert warning.filename == __file__  # the user's line, where Lightning's filter shows it


def test_the_from_import_statement_of_1x_code_works_and_warns() -> None:
    expected = "Use `from lightning_fairscale.precision.sharded_amp import ShardedMixedPrecisionPlugin`."
    with pytest.warns(DeprecationWarning, match=re.escape(expected)):
        from lightning_fairscale.precision.sharded_amp import ShardedNativeMixedPrecisionPlugin
    from lightning_fairscale.precision.sharded import ShardedMixedPrecisionPlugin

    assert ShardedNativeMixedPrecisionPlugin is ShardedMixedPrecisionPlugin


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_sharded_amp_has_fairscales_grad_scaler_as_1x_and_the_extension(flavour: str) -> None:
    """``pytorch_lightning.plugins.precision.sharded_native_amp.ShardedGradScaler`` was FairScale's, and so was the
    extension's: the plugin's fp16 scaler on CUDA (elsewhere the plugin makes the device-generic one)."""
    assert _module(flavour, "precision.sharded_amp").ShardedGradScaler is FairScaleShardedGradScaler


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("module", sorted({m for m, _ in EXTENSION.keys() | RENAMED.keys()}))
def test_every_module_is_a_real_file_whose_names_warn_only_when_asked_for(flavour: str, module: str) -> None:
    namespace = _module(flavour, module)
    if module:
        expected = Path(*module.split(".")).with_suffix(".py")
        if Path(namespace.__file__).name == "__init__.py":
            expected = Path(*module.split("."), "__init__.py")
        assert Path(namespace.__file__).as_posix().endswith(f"{flavour.replace('.', '/')}/{expected.as_posix()}")
    # Star imports, `dir()` and tools that scan a module (doctest collection, Sphinx, IDEs) see no deprecated name.
    _no_deprecation(lambda: exec(f"from {namespace.__name__} import *", {}))
    _no_deprecation(lambda: inspect.getmembers(namespace))
    assert not hasattr(namespace, "NoSuchPlugin")


@pytest.mark.parametrize(
    ("plugin", "legacy", "precision", "scaler"),
    [
        (SHARDED_MIXED, 16, "16-mixed", ShardedGradScaler),
        (SHARDED_MIXED, "16", "16-mixed", ShardedGradScaler),
        (SHARDED_MIXED, "bf16", "bf16-mixed", type(None)),
        (FSDP_MIXED, 16, "16-mixed", ShardedGradScaler),
        (FSDP_MIXED, "bf16", "bf16-mixed", type(None)),
    ],
)
def test_1x_precision_values_build_the_plugin_with_a_deprecation(
    plugin: tuple[str, str], legacy: Any, precision: str, scaler: type
) -> None:
    """Lightning 1.x's ``ShardedNativeMixedPrecisionPlugin(precision=16, device=...)`` (Lightning 2's
    ``MixedPrecision`` refuses ``16``)."""
    cls = _todays("lightning_fairscale", plugin)
    with pytest.warns(DeprecationWarning) as caught:
        built = cls(precision=legacy, device="cpu")
    assert (built.precision, type(built.scaler)) == (precision, scaler)
    (warning,) = caught
    assert str(warning.message) == (
        f"`{cls.__name__}(precision={legacy!r})` is deprecated (Lightning 1.x's value): use precision={precision!r}."
    )
    assert warning.filename == __file__


def test_1x_fp16_on_cuda_gets_fairscales_scaler_as_in_1x() -> None:
    """Lightning 1.9.5's ``test_sharded_precision_scaler``: ``(16, None, ShardedGradScaler)`` on ``"cuda"``."""
    cls = _todays("lightning_fairscale", SHARDED_MIXED)
    with pytest.warns(DeprecationWarning), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # FairScale's scaler warns that CUDA is not available
        assert type(cls(precision=16, device="cuda").scaler) is FairScaleShardedGradScaler


@pytest.mark.parametrize("plugin", [SHARDED_MIXED, FSDP_MIXED])
def test_32_is_still_not_a_mixed_precision(plugin: tuple[str, str]) -> None:
    """1.x built a mixed-precision plugin without a scaler for ``32``; the strategies' full-precision plugins are
    the ones for it now, and Lightning's error says what the mixed ones take."""
    with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
        _no_deprecation(lambda: _todays("lightning_fairscale", plugin)(precision=32, device="cpu"))
