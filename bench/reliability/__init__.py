"""Shared pieces of the reliability tools (``bench/fault_injection.py``, ``bench/soak.py``) and of
``tests/reliability``: a runtime on its own thread, SSE parsing, request bodies, stream clients."""
