"""The conformance judges: vLLM's NIXL connector tests with upstream's classes and with ours
(``run``), vLLM's whole kv_connector suite on the unmigrated and the migrated kv_transfer
(``run_migrated``), the pytest plugins they load into vLLM's test processes
(``kvspec_conformance``, ``kvspec_migrated``), the fixture corrections, and the data they
judge by (``expected_differences.toml``, ``hub/``, ``stubs/``, ``upstream/``)."""
