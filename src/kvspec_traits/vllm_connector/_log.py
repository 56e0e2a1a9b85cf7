"""The package's one logger, a child of vLLM's ``vllm`` logger.

vLLM configures its ``vllm`` logger (its handler, its format with timestamps,
``VLLM_LOGGING_LEVEL``, ``propagate=False``): a logger outside it would print in
Python's default format, or not at all. A plain ``logging.getLogger`` of this name needs
no vLLM import (the pure modules log through it too) and joins vLLM's configuration once
vLLM has set it up. Every log line of the package goes here
(tests/test_connector_observe.py checks ``src/`` for any other logger).
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["LOGGER_NAME", "logger"]

LOGGER_NAME: Final = "vllm.kvspec_traits.connector"
logger = logging.getLogger(LOGGER_NAME)
