"""One error root (issue 21 item 3): every exception class any module of the package
defines derives from :class:`kvspec_traits.KVSpecTraitsError`, and keeps the builtin a
caller may already catch (``ValueError``, ``KeyError``, ``RuntimeError``, ...)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kvspec_traits
from kvspec_traits import KVSpecTraitsError

# The builtin each error of the transfer stack keeps (what callers caught before the
# root existed): the ones issue 21 names, checked by name so a rebase cannot drop one.
KEPT_BUILTINS: dict[str, type[BaseException]] = {
    "kvspec_traits.transfer._errors.HandshakeMismatchError": ValueError,
    "kvspec_traits.transfer._errors.MalformedMetadataError": ValueError,
    "kvspec_traits.transfer._errors.MemoryTypeMismatchError": ValueError,
    "kvspec_traits.transfer._errors.MissingLayerError": KeyError,
    "kvspec_traits.transfer._errors.RegionConflictError": ValueError,
    "kvspec_traits.transfer._errors.StageLayersError": ValueError,
    "kvspec_traits.transfer._errors.UnsupportedLayoutError": ValueError,
    "kvspec_traits.transfer._errors.BlockIdError": IndexError,
    "kvspec_traits.transfer._errors.BlockIdTypeError": TypeError,
    "kvspec_traits.transfer._errors.BlockIdShapeError": ValueError,
    "kvspec_traits.transfer._errors.DuplicateBlockIdError": ValueError,
    # One class each, re-exported by both backends (issue 49 item 1).
    "kvspec_traits.transfer._errors.MissingPeerError": KeyError,
    "kvspec_traits.transfer._errors.TransferFailedError": RuntimeError,
    "kvspec_traits.vllm_connector._errors.PeerWithoutTraitsError": RuntimeError,
    "kvspec_traits.vllm_connector._errors.UnsupportedVllmVersionError": RuntimeError,
    "kvspec_traits.vllm_connector._errors.UnsupportedPipelineParallelError": NotImplementedError,
    "kvspec_traits.vllm_connector._errors.VllmHandshakeRefusalError": AssertionError,
    "kvspec_traits.vllm_connector._errors.UnsupportedStagePairingError": NotImplementedError,
}


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in a module of the package (``__main__`` modules,
    which run a CLI when imported, aside), by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(kvspec_traits.__path__, "kvspec_traits."):
        if info.name.rpartition(".")[2] == "__main__":
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == info.name:
                found[f"{info.name}.{cls.__qualname__}"] = cls
    return found


def test_every_error_class_of_every_module_is_a_kvspec_traits_error() -> None:
    """Failure mode: the errors of ``transfer``, ``nixl``, ``vllm_connector`` and
    ``memcopy`` (the in-process backend Mooncake's replaced; and two of ``audit``)
    derived from builtins only, so ``except KVSpecTraitsError`` missed
    ``HandshakeMismatchError`` and the rest."""
    found = _exception_classes()
    assert set(KEPT_BUILTINS) <= set(found)
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, KVSpecTraitsError))
    assert outside == []
    # Each keeps a builtin narrower than Exception, so callers catching it still do.
    bare = sorted(
        name
        for name, cls in found.items()
        if cls is not KVSpecTraitsError
        and not any(
            base.__module__ == "builtins" and base not in (Exception, BaseException, object)
            for base in cls.__mro__
        )
    )
    assert bare == []
    for name, builtin in KEPT_BUILTINS.items():
        assert issubclass(found[name], builtin), name


def test_each_transfer_failure_is_one_class_that_both_backends_export() -> None:
    """Failure mode: ``MissingPeerError`` and ``TransferFailedError`` were each defined
    twice (in ``nixl._errors`` and ``mooncake._errors``), so ``except
    kvspec_traits.nixl.TransferFailedError`` missed the Mooncake backend's failure."""
    nixl = importlib.import_module("kvspec_traits.nixl")
    mooncake = importlib.import_module("kvspec_traits.mooncake")
    for name in ("MissingPeerError", "TransferFailedError"):
        assert getattr(nixl, name) is getattr(mooncake, name), name
        assert getattr(nixl, name).__module__ == "kvspec_traits.transfer._errors"
    # Defined once in the whole package: no module defines a second class of that name.
    found = _exception_classes()
    twice = (".MissingPeerError", ".TransferFailedError")
    assert sorted(n for n in found if n.endswith(twice)) == [
        "kvspec_traits.transfer._errors.MissingPeerError",
        "kvspec_traits.transfer._errors.TransferFailedError",
    ]
    failed = mooncake.TransferFailedError("engine returned -1", code=-1)
    assert (failed.code, failed.state) == (-1, None)
    assert isinstance(failed, nixl.TransferFailedError) and isinstance(failed, KVSpecTraitsError)
