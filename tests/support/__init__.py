"""Support shared by the tests and the reliability tools in bench/ (``bench/fault_injection.py``,
``bench/soak.py``, ``bench/reliability/storm.py``, ``bench/multi_gpu_run.py``): a runtime on its own
thread (``runtime_thread``), SSE parsing (``sse``), request bodies (``bodies``) and the route
fuzzer's cases and rule (``fuzz``). Development only, like all of tests/ and bench/: run from the
repository root (neither is installed nor published)."""
