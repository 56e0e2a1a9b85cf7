"""Named errors of planning and of the layout handshake (backend-neutral). Each carries
the region or message it is about."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "HandshakeMismatchError",
    "MalformedMetadataError",
    "MissingLayerError",
    "RegionConflictError",
    "TraitDiff",
    "UnsupportedLayoutError",
]

TraitDiff = tuple[str, object, object]
"""``(trait, local value, remote value)``."""


class RegionConflictError(ValueError):
    """Layers that share one storage region disagree on a fact the region needs.

    ``.region`` is the region name, ``.layers`` its member layers, ``.trait`` the fact
    and ``.values`` each layer's value.
    """

    def __init__(
        self, region: str, layers: Sequence[str], trait: str, values: Mapping[str, object]
    ) -> None:
        self.region = region
        self.layers = tuple(layers)
        self.trait = trait
        self.values = dict(values)
        shown = ", ".join(f"{layer}={value!r}" for layer, value in self.values.items())
        super().__init__(
            f"region {region!r} (layers {list(self.layers)}) cannot be transferred as one "
            f"region: its layers disagree on {trait} ({shown})"
        )


class MissingLayerError(KeyError):
    """Layers with a transferable KV cache spec that lack another per-layer input of
    :func:`plan_regions`: a tensor in ``kv_caches`` or an entry in ``group_ids``.

    ``.layers`` names them, ``.missing_from`` the input (``"kv_caches"`` or
    ``"group_ids"``).
    """

    def __init__(self, layers: Sequence[str], missing_from: str, fix: str) -> None:
        self.layers = tuple(layers)
        self.missing_from = missing_from
        self.message = (
            f"layers {list(self.layers)} have a KV cache spec but no entry in {missing_from}; {fix}"
        )
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would show the message as a quoted repr
        return self.message


class UnsupportedLayoutError(ValueError):
    """A cache tensor's shape or strides cannot be described as NIXL regions.

    ``.layer`` names the layer.
    """

    def __init__(self, layer: str, reason: str) -> None:
        self.layer = layer
        super().__init__(f"layer {layer!r}: {reason}")


class HandshakeMismatchError(ValueError):
    """Producer and consumer disagree on a region: no transfer may start.

    ``.region`` is the region index (``None`` when the region count or plan-wide facts
    differ), ``.region_name`` and ``.layers`` name it, ``.diffs`` lists
    ``(trait, local, remote)`` for every differing trait.
    """

    def __init__(
        self,
        region: int | None,
        region_name: str,
        layers: Sequence[str],
        diffs: Sequence[TraitDiff],
    ) -> None:
        self.region = region
        self.region_name = region_name
        self.layers = tuple(layers)
        self.diffs = tuple(diffs)
        where = (
            f"region {region} {region_name!r} (layers {list(self.layers)})"
            if region is not None
            else f"the plan ({region_name})"
        )
        what = "; ".join(
            f"{trait}: local={local!r} remote={remote!r}" for trait, local, remote in self.diffs
        )
        super().__init__(
            f"KV layout handshake refused: producer and consumer differ on {where}: {what}"
        )


class MalformedMetadataError(ValueError):
    """Handshake metadata that cannot be decoded or cannot be trusted (truncated, wrong
    magic or version, invalid or hostile JSON, missing fields, region geometry that
    contradicts the peer's own fingerprint). ``.reason`` says which."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed kvspec-traits NIXL metadata: {reason}")
