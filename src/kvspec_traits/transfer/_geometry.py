"""Tensor geometry: one layer's cache view -> region candidates (pieces).

Pure: a tensor is read only for its address, shape, strides, element size and storage
(torch is never imported here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from kvspec_traits._traits import KVLayoutTraits, TokenScope, TPLayout
from kvspec_traits.transfer._errors import UnsupportedLayoutError
from kvspec_traits.transfer._region import MemoryRange, is_state

if TYPE_CHECKING:
    import torch

__all__ = [
    "Piece",
    "as_member_row",
    "as_rows",
    "device_id_of",
    "layer_pieces",
    "mem_type_of",
    "paged_ratio",
]


@dataclass(slots=True)
class Piece:
    """One region candidate from one layer."""

    layer: str
    traits: KVLayoutTraits
    group_id: int
    base: int
    block_len: int
    block_stride: int
    num_blocks: int
    mem_type: str
    device_id: int
    head_major: bool
    head_segment: tuple[int, int] | None
    row_member: tuple[int, int] | None = None
    """``(offset, page bytes)`` of the layer's page in a whole-row piece."""


def mem_type_of(cache: torch.Tensor) -> str:
    return "DRAM" if cache.device.type == "cpu" else "VRAM"


def device_id_of(cache: torch.Tensor) -> int:
    return 0 if cache.device.type == "cpu" else max(cache.get_device(), 0)


def _dense(sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether elements of these sizes/byte strides fill one gap-free byte run."""
    dims = sorted(
        ((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1), reverse=True
    )
    expected = itemsize
    for stride, size in reversed(dims):
        if stride != expected:
            return False
        expected = stride * size
    return True


def paged_ratio(
    kv_caches: Mapping[str, torch.Tensor],
    layer_traits: Mapping[str, KVLayoutTraits],
    layer_blocks: Mapping[str, int],
    num_blocks: int,
) -> int:
    """The kernel blocks per manager block of the paged views (1 if none is split)."""
    ratios = {
        layer: kv_caches[layer].shape[0] // layer_blocks.get(layer, num_blocks)
        for layer, traits in layer_traits.items()
        if not is_state(traits)
        and kv_caches[layer].ndim > 1
        and layer_blocks.get(layer, num_blocks) > 0
    }
    distinct = set(ratios.values())
    if len(distinct) > 1:
        raise ValueError(
            f"paged views split manager blocks into different numbers of "
            f"kernel blocks {ratios}; pass kernel_ratio"
        )
    return distinct.pop() if distinct else 1


def layer_pieces(
    layer: str,
    cache: torch.Tensor,
    traits: KVLayoutTraits,
    group_id: int,
    num_blocks: int,
    kernel_blocks: bool = False,
    kernel_ratio: int | None = None,
    storage: MemoryRange | None = None,
) -> Iterable[Piece]:
    """The region(s) of one layer's cache view. With ``storage`` (the allocation the
    view lies in), a paged view whose block is not one dense page, in a block-major
    storage, is the whole storage row (vLLM's rule)."""
    mem_type, device_id = mem_type_of(cache), device_id_of(cache)
    page = traits.page_size_bytes
    state = is_state(traits)

    def piece(
        base: int,
        block_len: int,
        stride: int,
        blocks: int,
        head_major: bool,
        segment: tuple[int, int] | None = None,
    ) -> Piece:
        return Piece(
            layer=layer,
            traits=traits,
            group_id=group_id,
            base=base,
            block_len=block_len,
            block_stride=stride,
            num_blocks=blocks,
            mem_type=mem_type,
            device_id=device_id,
            head_major=head_major,
            head_segment=segment,
        )

    if state and kernel_blocks and kernel_ratio is not None and kernel_ratio > 1:
        # vLLM's worker registers a state page as `ratio` kernel-sized blocks (a region
        # it can share with split attention pages) and reads it back whole, `ratio`
        # kernel blocks apart: valid only when the state pages abut.
        rows = cache.shape[0] if cache.ndim > 1 else num_blocks
        logical_stride = (
            cache.stride(0) * cache.element_size() * (rows // num_blocks)
            if cache.ndim > 1 and num_blocks
            else page
        )
        if page % kernel_ratio or rows % max(num_blocks, 1) or logical_stride != page:
            raise UnsupportedLayoutError(
                layer,
                f"state pages of {page} bytes at stride {logical_stride} cannot "
                f"be registered as {kernel_ratio} kernel blocks each",
            )
        kernel_page = page // kernel_ratio
        return [piece(cache.data_ptr(), kernel_page, kernel_page, num_blocks * kernel_ratio, True)]
    if cache.ndim <= 1:
        # A flat byte view (a raw buffer shared between layer types) has no block
        # dimension: blocks abut, one page apart.
        if kernel_blocks and kernel_ratio is not None and kernel_ratio > 1 and not state:
            if page % kernel_ratio:
                raise UnsupportedLayoutError(
                    layer, f"page of {page} bytes does not split into {kernel_ratio} kernel blocks"
                )
            kernel_page = page // kernel_ratio
            return [
                piece(cache.data_ptr(), kernel_page, kernel_page, num_blocks * kernel_ratio, True)
            ]
        return [piece(cache.data_ptr(), page, page, num_blocks, True)]
    itemsize = cache.element_size()
    rows = cache.shape[0]
    stride0 = cache.stride(0) * itemsize
    # Kernel block splitting views a manager block as `ratio` kernel blocks; a
    # recurrent state is indivisible and never split.
    ratio = 1 if state else rows // num_blocks
    if kernel_blocks and kernel_ratio is not None and not state and ratio != kernel_ratio:
        raise UnsupportedLayoutError(
            layer,
            f"{rows} rows for {num_blocks} blocks are not split into the worker's "
            f"{kernel_ratio} kernel blocks per block (shape {tuple(cache.shape)})",
        )
    if ratio < 1 or (not state and rows != ratio * num_blocks) or rows < num_blocks:
        raise UnsupportedLayoutError(
            layer,
            f"{rows} rows cannot hold {num_blocks} blocks "
            f"(shape {tuple(cache.shape)}, {traits.spec_name})",
        )
    sizes = tuple(cache.shape[1:])
    strides = tuple(s * itemsize for s in cache.stride()[1:])
    if ratio > 1 and not kernel_blocks:
        # vLLM splits a manager block into kernel blocks only when the block is one
        # dense page (create_kv_cache_views), so `ratio` abutting kernel pages are the
        # manager page: plan in manager blocks, the ids requests use (vLLM's worker
        # registers kernel blocks: block_len / ratio, num_blocks x ratio).
        kernel_page = prod(sizes) * itemsize
        if not (
            _dense(sizes, strides, itemsize)
            and kernel_page == stride0
            and kernel_page * ratio == page
        ):
            raise UnsupportedLayoutError(
                layer,
                f"{ratio} kernel blocks of {kernel_page} bytes at stride {stride0} "
                f"do not tile its {page}-byte page",
            )
        return [piece(cache.data_ptr(), page, page, num_blocks, sizes[0] == 1)]
    if page % ratio:
        raise UnsupportedLayoutError(
            layer, f"page of {page} bytes does not split into {ratio} kernel blocks"
        )
    block_len, blocks = page // ratio, num_blocks * ratio
    page_dense = _dense(sizes, strides, itemsize)
    if (
        storage is not None
        and not (page_dense and prod(sizes) * itemsize == block_len)
        and 0 <= storage.length - blocks * stride0 < stride0
        and storage.base <= cache.data_ptr() < storage.base + stride0
    ):
        # The view's block is not one dense page (layers interleaved inside a block,
        # BHLNC; or a page padded past its content, DeepSeek-V4 rows) in a storage of
        # `blocks` rows: the region is the whole row, shared by every layer of the
        # storage, as vLLM registers it. Moving the row moves each member's block.
        return [piece(storage.base, stride0, stride0, blocks, False)]
    if page_dense:
        if blocks > 1 and block_len > stride0:
            raise UnsupportedLayoutError(
                layer, f"pages of {block_len} bytes overlap at block stride {stride0}"
            )
        head_major = sizes[0] == 1 or (
            _dense(sizes[1:], strides[1:], itemsize) and strides[0] == prod(sizes[1:]) * itemsize
        )
        return [piece(cache.data_ptr(), block_len, stride0, blocks, head_major)]
    heads = sizes[0]
    if (
        heads > 1
        and strides[0] >= blocks * stride0
        and _dense(sizes[1:], strides[1:], itemsize)
        and block_len % heads == 0
    ):
        # Heads outside blocks (an H-before-B layout): each head is its own segment
        # of `blocks` strided sub-pages.
        return [
            piece(
                cache.data_ptr() + h * strides[0],
                block_len // heads,
                stride0,
                blocks,
                True,
                (h, heads),
            )
            for h in range(heads)
        ]
    raise UnsupportedLayoutError(
        layer,
        f"shape {tuple(cache.shape)} with strides {tuple(cache.stride())} is neither "
        f"a dense page per block nor one segment per head",
    )


def as_rows(pieces: list[Piece], storage: MemoryRange) -> list[Piece]:
    """The pieces of one storage as whole-row pieces, if it is block-outermost."""
    strides = {p.block_stride for p in pieces}
    counts = {p.num_blocks for p in pieces}
    if len(strides) != 1 or len(counts) != 1:
        return pieces
    stride, count = strides.pop(), counts.pop()
    block_major = 0 <= storage.length - count * stride < stride
    inside = all(
        storage.base <= p.base and p.base - storage.base + p.block_len <= stride for p in pieces
    )
    has_state = any(is_state(p.traits) for p in pieces)
    if not block_major or not inside or has_state or stride <= max(p.block_len for p in pieces):
        return pieces
    return [
        Piece(
            layer=p.layer,
            traits=p.traits,
            group_id=p.group_id,
            base=storage.base,
            block_len=stride,
            block_stride=stride,
            num_blocks=count,
            mem_type=p.mem_type,
            device_id=p.device_id,
            head_major=False,
            head_segment=None,
        )
        for p in pieces
    ]


def as_member_row(piece: Piece, storage: MemoryRange) -> Piece:
    """``piece`` as a whole-row piece remembering where its page sits, if it is a
    replicated latent token page of a block-major storage; else ``piece``."""
    traits = piece.traits
    stride = piece.block_stride
    offset = piece.base - storage.base
    if not (
        traits.is_mla
        and traits.tp_layout is TPLayout.REPLICATED
        and traits.token_scope not in (TokenScope.RING, TokenScope.RECURRENT_STATE)
        and piece.head_segment is None
        and 0 <= storage.length - piece.num_blocks * stride < stride
        and offset >= 0
        and offset + piece.block_len <= stride
    ):
        return piece
    return Piece(
        layer=piece.layer,
        traits=traits,
        group_id=piece.group_id,
        base=storage.base,
        block_len=stride,
        block_stride=stride,
        num_blocks=piece.num_blocks,
        mem_type=piece.mem_type,
        device_id=piece.device_id,
        head_major=False,
        head_segment=None,
        row_member=(offset, piece.block_len),
    )
