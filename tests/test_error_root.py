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
    "kvspec_traits.nixl._errors.MissingPeerError": KeyError,
    "kvspec_traits.nixl._errors.TransferFailedError": RuntimeError,
    "kvspec_traits.mooncake._errors.MissingPeerError": KeyError,
    "kvspec_traits.mooncake._errors.TransferFailedError": RuntimeError,
    "kvspec_traits.vllm_connector._errors.PeerWithoutTraitsError": RuntimeError,
    "kvspec_traits.vllm_connector._errors.UnsupportedVllmVersionError": RuntimeError,
    "kvspec_traits.vllm_connector._errors.UnsupportedPipelineParallelError": NotImplementedError,
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
