# Stub for the C extension `_warm.c` (a compiled module has no annotations to read).
from collections.abc import Callable
from typing import Any

class WarmCache:
    def __init__(self, by_id: dict[int, Any], resolve: Callable[[Any], Any]) -> None: ...
    def __call__(self, spec: Any, /) -> Any: ...
