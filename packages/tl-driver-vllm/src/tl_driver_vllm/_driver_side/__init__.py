"""Driver side of the vllm driver: the process that boots vLLM and talks to its workers.

Nothing here runs inside a worker; the worker side (``tl_driver_vllm._worker_side``) never
imports it. What both sides read (the family table, the wire format, dictionaries) lives
in the package's top-level modules.
"""
