"""Worker side of the vllm driver: what runs inside each vLLM worker process.

vLLM mixes ``TLWorkerExtension`` into every worker; it imports only this subpackage and the
package's shared top-level modules, never the driver side (``tl_driver_vllm._driver_side``).
"""
