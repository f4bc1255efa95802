"""What a sharded checkpoint holds, the checks on loading one, and its consolidation into a full checkpoint.

A sharded checkpoint (``DDPFullyShardedStrategy(state_dict_type="sharded")``) splits the Trainer's checkpoint dict,
or the dict ``fabric.save`` writes (see :mod:`lightning_fairscale.checkpoint.fabric`):

* each rank's **shard** (:func:`split_checkpoint`): its parameter shards (FairScale's ``local_state_dict``), its
  optimizer states over those shards, FairScale's ``local_metadata_dict`` (names, shapes and padding of every
  flattened parameter) and where each optimizer entry lives
  (:func:`~lightning_fairscale.fsdp.state.optim_state.describe_layout`);
* the **meta** dict: everything else under its own key (the Trainer's loops, callbacks, hparams, LR schedulers and
  versions; Fabric's other entries), and the checkpoint's own record under :data:`FORMAT_KEY`: the world size, the
  extra keys of layers reachable under several names and, for Fabric, the keys of the model and of the optimizers.

:func:`consolidate` turns the files back into the checkpoint a full save would have written, in one process with
no process group: parameters through FairScale's ``consolidate_shard_weights``, optimizer states through the same
plain-layout code the online consolidation uses. The file work (atomic writes, directories) is in
:mod:`lightning_fairscale.checkpoint.files`.
"""

from __future__ import annotations

import importlib.metadata

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel as _FairScaleFSDP
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fairscale.checkpoint.files import FABRIC_RECORD, FORMAT_KEY, load_meta, load_shard
from lightning_fairscale.fsdp.state.optim import GroupOrder, ParameterLayout, Piece
from lightning_fairscale.fsdp.state.optim_state import describe_layout, plain_state_dict
from lightning_fairscale.fsdp.state.resharding import SavedShards
from lightning_fairscale.fsdp.state.whole_state import consolidate_saved
from lightning_fairscale.fsdp.unit.state_names import apply_aliases, clean_path, fairscale_ties, state_aliases


__all__ = [
    "FABRIC_RECORD",
    "CURRENT_MODEL_STATE",
    "FORMAT_KEY",
    "check_fits",
    "check_wrapping",
    "consolidate",
    "consolidation_hint",
    "split_checkpoint",
    "wrapped_alike",
]

#: 2: each rank's optimizer state is over its views of the original parameters (``optimizer_layouts[j]["views"]``);
#: 1: over its whole shards of the managed parameters. Both load.
FORMAT_VERSION = 2

#: Where Lightning's ``WeightAveraging`` keeps the module's own weights in a Trainer's checkpoint while
#: ``state_dict`` holds the averaged ones: this rank's shards too, in a sharded checkpoint (the format's record lists
#: it under ``"model_states"``).
CURRENT_MODEL_STATE = "current_model_state"


def consolidation_hint(path: Any) -> str:
    """The sentence that tells users how to turn a sharded checkpoint into a full one."""
    source = Path(str(path))
    target = source.with_name(source.stem + "-full.ckpt")
    return (
        "Consolidate it into a full checkpoint, which loads on any number of processes, with any wrapping and"
        f" without FairScale: `lightning-fairscale-consolidate {source} {target}`, then load {target} instead (the"
        " Trainer's `ckpt_path`, or `fabric.load`)."
    )


def split_checkpoint(
    checkpoint: dict[str, Any], root: nn.Module, layout: ParameterLayout, optimizers: Sequence[Optimizer],
    orders: Sequence[GroupOrder], world_size: int, fabric: Optional[dict[str, Any]] = None,
    paths: Optional[Sequence[dict[str, Any]]] = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(meta, shard)``: a checkpoint dict made with local state dicts, split for a sharded save.

    ``checkpoint`` is the Trainer's (the model's state under ``"state_dict"``, the optimizers' under
    ``"optimizer_states"``), or, with ``fabric`` (``{"model": key, "optimizers": [keys]}``), what ``fabric.save``
    writes: the model's and the optimizers' states under those keys, which the meta dict then records.

    ``paths`` (one per optimizer) adds what the whole path records of each optimizer to its layout (see
    :meth:`~lightning_fairscale.fsdp.state.whole_owners.WholePlan.describe`; ``{}``: the element-wise path).

    Raises:
        ValueError: a Fabric state has an entry named :data:`FORMAT_KEY`, the meta dict's own.
    """
    if fabric is not None and FORMAT_KEY in checkpoint:
        raise ValueError(
            f"The state's entry {FORMAT_KEY!r} has the name that a sharded checkpoint's meta file uses for its own"
            " record. Rename this entry."
        )
    model_key = "state_dict" if fabric is None else fabric["model"]
    optimizer_keys = ["optimizer_states"] if fabric is None else list(fabric["optimizers"])
    model_keys = [model_key] + ([CURRENT_MODEL_STATE] if fabric is None and CURRENT_MODEL_STATE in checkpoint else [])
    meta = {k: v for k, v in checkpoint.items() if k not in model_keys and k not in optimizer_keys}
    meta[FORMAT_KEY] = {
        "format_version": FORMAT_VERSION,
        "world_size": world_size,
        "aliases": state_aliases(root),
        "versions": {
            "lightning_fairscale": _package_version(),
            "torch": str(torch.__version__),
            "fairscale": _fairscale_version(),
        },
        # A filtered Fabric checkpoint's `kept` too (`fabric.save(..., filter=...)`).
        **({FABRIC_RECORD: {**fabric, "model": model_key, "optimizers": optimizer_keys}} if fabric is not None else {}),
        **({"model_states": model_keys} if len(model_keys) > 1 else {}),
    }
    shard: dict[str, Any] = {
        "state_dict": checkpoint[model_key],
        "shard_metadata": _metadata(root),
        "world_size": world_size,
    }
    for key in model_keys[1:]:
        shard[key] = checkpoint[key]
    if fabric is not None:
        shard["optimizer_states"] = [checkpoint[k] for k in optimizer_keys]
    elif "optimizer_states" in checkpoint:  # (a Trainer's saved with weights only has none)
        shard["optimizer_states"] = checkpoint["optimizer_states"]
    if "optimizer_states" in shard:
        extras = list(paths) if paths is not None else [{} for _ in optimizers]
        shard["optimizer_layouts"] = [
            {**describe_layout(opt, order, root, layout), **extra}
            for opt, order, extra in zip(optimizers, orders, extras)
        ]
    return meta, shard


def _package_version() -> str:
    """This package's version, from its installed metadata: the engine does not import the package itself (which
    imports Lightning)."""
    try:
        return importlib.metadata.version("lightning_fairscale")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def _fairscale_version() -> str:
    import fairscale

    return str(fairscale.__version__)


def _metadata(root: nn.Module) -> dict[str, Any]:
    assert isinstance(root, _FairScaleFSDP)
    return root.local_metadata_dict()


def _comparable(metadata: dict[str, Any]) -> list[Any]:
    """The wrapping that ``metadata`` describes: units, flattened parameters and their pieces (padding aside)."""
    return [
        (
            unit["fsdp_path"],
            [
                (name, info["names"], [tuple(s) for s in info["shapes"]], info["numels"])
                for name, info in unit["params"].items()
            ],
        )
        for unit in metadata["param_metadata"]
    ]


def check_fits(meta: dict[str, Any], path: Any) -> int:
    """The number of processes that saved the sharded checkpoint; a ``ValueError`` when ``meta`` is not ours.

    Any number of processes can resume it (:class:`lightning_fairscale.fsdp.state.resharding.SavedShards`).
    """
    info = meta.get(FORMAT_KEY)
    if not isinstance(info, dict) or "world_size" not in info:
        raise ValueError(f"{path} is not a sharded checkpoint written by lightning-fairscale (its meta.pt has no"
                         f" '{FORMAT_KEY}' entry).")
    return int(info["world_size"])


def wrapped_alike(shard: dict[str, Any], root: nn.Module) -> bool:
    """Whether ``root`` has the saved model's FSDP units, with the same parameters in each."""
    return _comparable(shard["shard_metadata"]) == _comparable(_metadata(root))


def check_wrapping(shard: dict[str, Any], root: nn.Module, path: Any) -> None:
    """Raise a ``ValueError`` naming the consolidation command when ``root`` is wrapped unlike the saved model."""
    saved, current = _comparable(shard["shard_metadata"]), _comparable(_metadata(root))
    if saved != current:
        saved_units = [unit for unit, _ in saved]
        current_units = [unit for unit, _ in current]
        raise ValueError(
            f"The sharded checkpoint {path} was saved from a model wrapped differently (FSDP units {saved_units}, this"
            f" run has {current_units}, or their parameters differ). Sharded checkpoints load, on any number of"
            f" processes, into the same model with the same wrapping. {consolidation_hint(path)}"
        )


# ----------------------------------------------------------------------------------------------------------------
# Offline consolidation


def consolidate(path: Any, progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """The full checkpoint equivalent to the sharded checkpoint directory ``path``, built in this process alone.

    The result is what ``state_dict_type="full"`` would have saved, in the layout it was saved in: the Trainer's
    (``state_dict`` with the unwrapped module's keys and shapes, ``optimizer_states`` in the layout of plain
    optimizers over the unwrapped module, and the trainer's state; it also loads with
    ``LightningModule.load_from_checkpoint``), or Fabric's (the model's and the optimizers' states under the keys the
    state gave them, in the same layouts, and its other entries). It loads on any number of processes.
    """
    say = progress or (lambda message: None)
    meta = load_meta(Path(path), weights_only=False)
    info = meta.pop(FORMAT_KEY, None)
    if not isinstance(info, dict) or "world_size" not in info:
        raise ValueError(f"{path} is not a sharded checkpoint written by lightning-fairscale.")
    world_size = int(info["world_size"])
    shards = []
    for rank in range(world_size):
        say(f"reading shard {rank + 1}/{world_size}")
        shards.append(load_shard(Path(path), rank, world_size, weights_only=False))
    say("consolidating parameters")
    aliases = [*info.get("aliases", []), *fairscale_ties(shards[0]["shard_metadata"])]
    kept = (info.get(FABRIC_RECORD) or {}).get("kept")

    def model_state(key: str) -> dict[str, Any]:
        if kept is not None:  # `fabric.save(..., filter=...)`: the keys kept, each read from the shards that hold it
            saved = SavedShards(lambda rank: {**shards[rank], "state_dict": shards[rank][key]}, world_size)
            pieces = saved.pieces(aliases)
            buffers = apply_aliases(saved.buffers(lambda name: clean_path(name + ".").rstrip(".")), aliases)
            return {k: saved.read_piece(pieces[k]) if k in pieces else buffers[k].clone() for k in kept}
        state = _FairScaleFSDP.consolidate_shard_weights(
            [_flat_shards(s[key], s["shard_metadata"]) for s in shards],
            [_saved_buffers_only(s["shard_metadata"], s[key]) for s in shards],
        )
        return apply_aliases({k: v.clone() for k, v in state.items()}, aliases)

    state_dict = model_state("state_dict")
    say(f"consolidated {len(state_dict)} parameters and buffers")
    optimizer_states = []
    count = len(shards[0].get("optimizer_states", []))
    for j in range(count):
        say(f"consolidating optimizer {j + 1}/{count}")
        optimizer_states.append(
            _consolidate_optimizer(
                [s["optimizer_states"][j] for s in shards],
                [s["optimizer_layouts"][j] for s in shards],
                [s["shard_metadata"] for s in shards],
            )
        )
    fabric = info.get(FABRIC_RECORD)
    if fabric is not None:  # Fabric's layout: the states under the keys of the state saved
        return {fabric["model"]: state_dict, **dict(zip(fabric["optimizers"], optimizer_states)), **meta}
    checkpoint = {**meta, "state_dict": state_dict}
    for key in info.get("model_states", [])[1:]:  # WeightAveraging's: the model's own weights beside the average
        checkpoint[key] = model_state(key)
    if "optimizer_states" in shards[0]:
        checkpoint["optimizer_states"] = optimizer_states
    return checkpoint


def _consolidate_optimizer(
    states: list[dict[str, Any]], layouts: list[dict[str, Any]], metadata: list[dict[str, Any]]
) -> dict[str, Any]:
    """One optimizer's state over the unwrapped module, from every rank's state over its views (or, in checkpoints
    written before views, over its whole shards; on the whole path, its owners' whole states)."""
    layout = layouts[0]
    if layout.get("path") == "whole":  # each parameter's state is its owner's, whole
        return consolidate_saved(states, layouts)
    full_states: list[dict[str, Any]] = []
    elementwise: list[set[str]] = []
    pieces: list[list[Piece]] = []
    stateful: list[set[int]] = []
    piece_values: list[dict[int, dict[str, Any]]] = []
    for m, (u, i) in enumerate(layout["params"]):
        per_rank = [_param_metadata(meta, u, i) for meta in metadata]
        unit_path, name, info = per_rank[0]
        numels = list(info["numels"])
        offsets = [sum(numels[:k]) for k in range(len(numels))]
        prefix = f"{unit_path}." if unit_path else ""
        pieces.append(
            [
                Piece(prefix + n, o, c, torch.Size(s))
                for n, o, c, s in zip(info["names"], offsets, numels, info["shapes"])
            ]
        )
        ranks = range(1 if metadata[0]["param_metadata"][u]["no_broadcast_optim_state"] else len(states))
        pads = [per_rank[r][2]["padding"] for r in ranks]
        shard_numel = (sum(numels) + sum(pads)) // len(pads)
        values: dict[int, dict[str, Any]] = {}
        if "views" in layout:
            full, keys, with_state = _from_views(
                m, sum(numels), shard_numel, [(states[r], layouts[r]) for r in ranks], values
            )
        else:
            full, keys = _from_managed_shards(m, shard_numel, [(states[r], pads[k]) for k, r in enumerate(ranks)])
            with_state = set(range(len(numels))) if full else set()
        full_states.append(full)
        piece_values.append(values)
        elementwise.append(keys)
        stateful.append(with_state)
    return plain_state_dict(
        full_states, pieces, layout["orders"], states[0]["param_groups"], elementwise, stateful, piece_values
    )


def _from_views(
    m: int, numel: int, shard_numel: int, ranks: list[tuple[dict[str, Any], dict[str, Any]]],
    values: dict[int, dict[str, Any]],
) -> tuple[dict[str, Any], set[str], set[int]]:
    """Managed parameter ``m``'s whole state, its element-wise keys and the pieces with state, from every rank's
    views of it (rank ``r``'s view ``[start, stop)`` of its shard is ``[r * shard_numel + start, ...)`` overall);
    ``values`` gets each piece's own per-parameter values (``step``: a piece frozen for a while lags)."""
    full: dict[str, Any] = {}
    keys: set[str] = set()
    with_state: set[int] = set()
    for r, (state, layout) in enumerate(ranks):
        for j, (owner, piece, start, stop) in enumerate(layout["views"]):
            entry = state["state"].get(j)
            if owner != m or not entry or start == stop:  # an empty view holds nothing of the parameter
                continue
            with_state.add(piece)
            for key, value in entry.items():
                if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == stop - start:
                    keys.add(key)
                    if key not in full:
                        full[key] = value.new_zeros(numel)
                    at = r * shard_numel + start
                    full[key][at : at + stop - start] = value
                else:
                    full.setdefault(key, copy.deepcopy(value))
                    values.setdefault(piece, {}).setdefault(key, value)
    return full, keys, with_state


def _from_managed_shards(
    m: int, shard_numel: int, ranks: list[tuple[dict[str, Any], int]]
) -> tuple[dict[str, Any], set[str]]:
    """Managed parameter ``m``'s whole state and its element-wise keys, from every rank's state over its whole shard
    (``(state dict, padding)`` per rank)."""
    state = ranks[0][0]["state"].get(m, {})
    keys = {k for k, v in state.items() if isinstance(v, Tensor) and v.dim() > 0 and v.numel() == shard_numel}
    full = {
        key: torch.cat([_unpad(s["state"][m][key], pad) for s, pad in ranks]) if key in keys else copy.deepcopy(value)
        for key, value in state.items()
    }
    return full, keys


def _flat_shards(state_dict: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every managed parameter 1-D, as FairScale's consolidation expects its shards: a unit of
    one rank does not shard, so ``flatten_parameters=False`` leaves its parameters in their own shapes there."""
    managed = {
        (f"{unit['fsdp_path']}." if unit["fsdp_path"] else "") + name
        for unit in metadata["param_metadata"]
        for name in unit["params"]
    }
    return {k: v.reshape(-1) if k in managed else v for k, v in state_dict.items()}


def _saved_buffers_only(metadata: dict[str, Any], state_dict: dict[str, Any]) -> dict[str, Any]:
    """FairScale's metadata with only the buffers the shard holds: its ``buffer_names`` lists every buffer, also the
    non-persistent ones a state dict leaves out (Llama's ``rotary_emb.inv_freq``), which its consolidation would then
    look for and fail on."""
    return {**metadata, "buffer_names": [name for name in metadata["buffer_names"] if name in state_dict]}


def _param_metadata(metadata: dict[str, Any], unit: int, index: int) -> tuple[str, str, dict[str, Any]]:
    entry = metadata["param_metadata"][unit]
    name = list(entry["params"])[index]
    return entry["fsdp_path"], name, entry["params"][name]


def _unpad(shard: Tensor, padding: int) -> Tensor:
    return shard.reshape(-1)[: shard.numel() - padding] if padding else shard.reshape(-1)
