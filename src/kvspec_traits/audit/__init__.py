"""``kvspec-traits audit``: where code asks a KV cache spec for its class instead of its
traits, which trait each branch asks for, and which spec classes it leaves out.

Scanning never imports vLLM; the class sets each trait value covers are computed from the
installed vLLM through :mod:`kvspec_traits.catalog` and cached. See docs/audit.md.
"""

from kvspec_traits.audit._audit import AuditResult, audit_paths
from kvspec_traits.audit._cli import EXIT_FILE_ERRORS, EXIT_MISSES, EXIT_USAGE, main
from kvspec_traits.audit._files import FileError
from kvspec_traits.audit._infer import Answer, Site, infer
from kvspec_traits.audit._scan import RawSite, scan_module
from kvspec_traits.audit._universe import (
    ClassInfo,
    ClassSetsUnavailableError,
    Universe,
    load_universe,
)

__all__ = [
    "EXIT_FILE_ERRORS",
    "EXIT_MISSES",
    "EXIT_USAGE",
    "Answer",
    "AuditResult",
    "ClassInfo",
    "ClassSetsUnavailableError",
    "FileError",
    "RawSite",
    "Site",
    "Universe",
    "audit_paths",
    "infer",
    "load_universe",
    "main",
    "scan_module",
]
