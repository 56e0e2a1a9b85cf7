"""Tensor geometry: one layer's cache view -> region candidates (pieces).

Pure: a tensor is read only for its address, shape, strides, element size and storage
(torch is never imported here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from kvspec_traits._traits import KVLayoutTraits, TPLayout, is_state
from kvspec_traits.transfer._errors import UnsupportedLayoutError
from kvspec_traits.transfer._region import MemoryRange, Rows

if TYPE_CHECKING:
    import torch

__all__ = [
    "Piece",
    "as_row",
    "block_major",
    "device_id_of",
    "layer_pieces",
    "mem_type_of",
    "rows_of",
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


@dataclass(frozen=True, slots=True)
class _PieceOf:
    """Makes the pieces of one layer: what every piece of it shares."""

    layer: str
    traits: KVLayoutTraits
    group_id: int
    mem_type: str
    device_id: int

    def __call__(
        self,
        base: int,
        block_len: int,
        stride: int,
        blocks: int,
        head_major: bool,
        segment: tuple[int, int] | None = None,
    ) -> Piece:
        return Piece(
            layer=self.layer,
            traits=self.traits,
            group_id=self.group_id,
            base=base,
            block_len=block_len,
            block_stride=stride,
            num_blocks=blocks,
            mem_type=self.mem_type,
            device_id=self.device_id,
            head_major=head_major,
            head_segment=segment,
        )


def layer_pieces(
    layer: str,
    cache: torch.Tensor,
    traits: KVLayoutTraits,
    group_id: int,
    num_blocks: int,
    sub_blocks: int | None = None,
    storage: MemoryRange | None = None,
) -> Iterable[Piece]:
    """The region(s) of one layer's cache view, in ``sub_blocks`` per block
    (:attr:`PlanLayout.sub_blocks`). With ``storage`` (the allocation the view lies
    in), a paged view whose block is not one dense page is the whole row of its
    block-major storage (:attr:`Rows.SCATTERED`)."""
    piece = _PieceOf(layer, traits, group_id, mem_type_of(cache), device_id_of(cache))
    split = sub_blocks is not None and sub_blocks > 1
    if is_state(traits) and split:
        return [_state_sub_blocks(piece, cache, num_blocks, sub_blocks or 1)]
    if cache.ndim <= 1:
        return [_flat_piece(piece, cache, num_blocks, sub_blocks)]
    ratio = _kernel_ratio(piece, cache, num_blocks, sub_blocks)
    if ratio > 1 and sub_blocks is None:
        return [_manager_page(piece, cache, num_blocks, ratio)]
    return _paged_pieces(piece, cache, num_blocks, ratio, storage)


def _state_sub_blocks(
    piece: _PieceOf, cache: torch.Tensor, num_blocks: int, sub_blocks: int
) -> Piece:
    """A state page as ``sub_blocks`` sub-blocks (a region it can share with split pages),
    read back whole ``sub_blocks`` apart: valid only when state pages abut."""
    page = piece.traits.page_size_bytes
    rows = cache.shape[0] if cache.ndim > 1 else num_blocks
    logical_stride = (
        cache.stride(0) * cache.element_size() * (rows // num_blocks)
        if cache.ndim > 1 and num_blocks
        else page
    )
    if page % sub_blocks or rows % max(num_blocks, 1) or logical_stride != page:
        raise UnsupportedLayoutError(
            piece.layer,
            f"state pages of {page} bytes at stride {logical_stride} cannot "
            f"be registered as {sub_blocks} kernel blocks each",
        )
    kernel_page = page // sub_blocks
    return piece(cache.data_ptr(), kernel_page, kernel_page, num_blocks * sub_blocks, True)


def _flat_piece(
    piece: _PieceOf, cache: torch.Tensor, num_blocks: int, sub_blocks: int | None
) -> Piece:
    """A flat byte view (a raw buffer shared between layer types) has no block dimension:
    blocks abut, one page apart (or ``sub_blocks`` kernel pages a block)."""
    page = piece.traits.page_size_bytes
    if sub_blocks is None or sub_blocks <= 1:
        return piece(cache.data_ptr(), page, page, num_blocks, True)
    if page % sub_blocks:
        raise UnsupportedLayoutError(
            piece.layer, f"page of {page} bytes does not split into {sub_blocks} kernel blocks"
        )
    kernel_page = page // sub_blocks
    return piece(cache.data_ptr(), kernel_page, kernel_page, num_blocks * sub_blocks, True)


def _kernel_ratio(
    piece: _PieceOf, cache: torch.Tensor, num_blocks: int, sub_blocks: int | None
) -> int:
    """How many rows of the view make one block: kernel block splitting views a manager
    block as that many kernel blocks; a recurrent state is indivisible and never split.
    Raises when the rows do not hold the blocks, or do not split as the worker's
    ``sub_blocks`` say."""
    state = is_state(piece.traits)
    rows = cache.shape[0]
    ratio = 1 if state else rows // num_blocks
    if sub_blocks is not None and not state and ratio != sub_blocks:
        raise UnsupportedLayoutError(
            piece.layer,
            f"{rows} rows for {num_blocks} blocks are not split into the worker's "
            f"{sub_blocks} kernel blocks per block (shape {tuple(cache.shape)})",
        )
    if ratio < 1 or (not state and rows != ratio * num_blocks) or rows < num_blocks:
        raise UnsupportedLayoutError(
            piece.layer,
            f"{rows} rows cannot hold {num_blocks} blocks "
            f"(shape {tuple(cache.shape)}, {piece.traits.spec_name})",
        )
    return ratio


def _manager_page(piece: _PieceOf, cache: torch.Tensor, num_blocks: int, ratio: int) -> Piece:
    """vLLM splits a manager block into kernel blocks only when the block is one dense page
    (create_kv_cache_views), so ``ratio`` abutting kernel pages are the manager page: plan
    in manager blocks, the ids requests use (vLLM's worker registers kernel blocks:
    block_len / ratio, num_blocks x ratio)."""
    page = piece.traits.page_size_bytes
    itemsize = cache.element_size()
    stride0 = cache.stride(0) * itemsize
    sizes = tuple(cache.shape[1:])
    strides = tuple(s * itemsize for s in cache.stride()[1:])
    kernel_page = prod(sizes) * itemsize
    if not (
        _dense(sizes, strides, itemsize) and kernel_page == stride0 and kernel_page * ratio == page
    ):
        raise UnsupportedLayoutError(
            piece.layer,
            f"{ratio} kernel blocks of {kernel_page} bytes at stride {stride0} "
            f"do not tile its {page}-byte page",
        )
    return piece(cache.data_ptr(), page, page, num_blocks, sizes[0] == 1)


def _paged_pieces(
    piece: _PieceOf,
    cache: torch.Tensor,
    num_blocks: int,
    ratio: int,
    storage: MemoryRange | None,
) -> list[Piece]:
    """A paged view of ``ratio`` rows a block: the whole row of its block-major storage
    when its block is not one dense page, else one dense page a block, else one segment
    per head (heads outside blocks)."""
    page = piece.traits.page_size_bytes
    if page % ratio:
        raise UnsupportedLayoutError(
            piece.layer, f"page of {page} bytes does not split into {ratio} kernel blocks"
        )
    itemsize = cache.element_size()
    stride0 = cache.stride(0) * itemsize
    sizes = tuple(cache.shape[1:])
    strides = tuple(s * itemsize for s in cache.stride()[1:])
    block_len, blocks = page // ratio, num_blocks * ratio
    page_dense = _dense(sizes, strides, itemsize)
    if storage is not None and not (page_dense and prod(sizes) * itemsize == block_len):
        # The view's block is not one dense page (layers interleaved inside a block,
        # BHLNC; or a page padded past its content, DeepSeek-V4 rows): in a block-major
        # storage the region is the whole row, shared by every layer of the storage.
        # Moving the row moves each member's block.
        row = as_row(piece(cache.data_ptr(), block_len, stride0, blocks, False), storage)
        if row is not None:
            return [row]
    if page_dense:
        if blocks > 1 and block_len > stride0:
            raise UnsupportedLayoutError(
                piece.layer, f"pages of {block_len} bytes overlap at block stride {stride0}"
            )
        head_major = sizes[0] == 1 or (
            _dense(sizes[1:], strides[1:], itemsize) and strides[0] == prod(sizes[1:]) * itemsize
        )
        return [piece(cache.data_ptr(), block_len, stride0, blocks, head_major)]
    return _head_segments(piece, cache, block_len, blocks)


def _head_segments(
    piece: _PieceOf, cache: torch.Tensor, block_len: int, blocks: int
) -> list[Piece]:
    """Heads outside blocks (an H-before-B layout): each head is its own segment of
    ``blocks`` strided sub-pages. Raises when the view is not that either."""
    itemsize = cache.element_size()
    stride0 = cache.stride(0) * itemsize
    sizes = tuple(cache.shape[1:])
    strides = tuple(s * itemsize for s in cache.stride()[1:])
    heads = sizes[0]
    if (
        heads > 1
        and strides[0] >= blocks * stride0
        and _dense(sizes[1:], strides[1:], itemsize)
        and block_len % heads == 0
    ):
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
        piece.layer,
        f"shape {tuple(cache.shape)} with strides {tuple(cache.stride())} is neither "
        f"a dense page per block nor one segment per head",
    )


def block_major(storage: MemoryRange, num_blocks: int, stride: int) -> bool:
    """Whether ``storage`` is ``num_blocks`` rows of ``stride`` bytes (plus less than a
    row): blocks outermost, so a block's row holds every page of it."""
    return 0 <= storage.length - num_blocks * stride < stride


def as_row(piece: Piece, storage: MemoryRange, *, member: bool = False) -> Piece | None:
    """``piece`` as the whole row of its block-major storage (base = the storage's, block
    length = stride, never split by heads), if its page lies inside the first row; with
    ``member``, remembering where the page sits in the row. ``None`` otherwise. The one
    whole-row mechanism: every :class:`Rows` choice goes through it."""
    stride = piece.block_stride
    offset = piece.base - storage.base
    if not (
        block_major(storage, piece.num_blocks, stride)
        and offset >= 0
        and offset + piece.block_len <= stride
    ):
        return None
    return Piece(
        layer=piece.layer,
        traits=piece.traits,
        group_id=piece.group_id,
        base=storage.base,
        block_len=stride,
        block_stride=stride,
        num_blocks=piece.num_blocks,
        mem_type=piece.mem_type,
        device_id=piece.device_id,
        head_major=False,
        head_segment=None,
        row_member=(offset, piece.block_len) if member else None,
    )


def _latent(piece: Piece) -> bool:
    """A replicated latent token page (:attr:`Rows.LATENT`), whole in one piece."""
    traits = piece.traits
    return (
        traits.is_mla
        and traits.tp_layout is TPLayout.REPLICATED
        and traits.token_paged
        and piece.head_segment is None
    )


def rows_of(
    pieces: list[Piece], storage: MemoryRange, rows: Rows, *, one_stride: bool
) -> list[Piece]:
    """The pieces of one storage with :attr:`Rows.ALL` and :attr:`Rows.LATENT` applied
    (:attr:`Rows.SCATTERED` is :func:`layer_pieces`'s, which sees the view's strides).
    ``one_stride``: every view of the plan shares this storage and one block stride
    (what :attr:`Rows.LATENT` needs)."""
    if Rows.ALL in rows and pieces:
        stride = pieces[0].block_stride
        if (
            {(p.block_stride, p.num_blocks) for p in pieces} == {(stride, pieces[0].num_blocks)}
            and not any(is_state(p.traits) for p in pieces)
            and stride > max(p.block_len for p in pieces)
        ):
            whole = [as_row(p, storage) for p in pieces]
            if all(row is not None for row in whole):
                pieces = [row for row in whole if row is not None]
    if Rows.LATENT in rows and one_stride:
        pieces = [(as_row(p, storage, member=True) if _latent(p) else None) or p for p in pieces]
    return pieces
