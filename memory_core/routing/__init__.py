"""The inference pass over adapter slots (what vLLM keeps as its ``lora/``): the device slot pools
(``slots``, ``slot_table``), the pass planned on the host (``plan``, staged by ``staging``), the pass
run from the plan and the pools alone (``planned``: serving's torch path, ``triton_block`` for the
kernel), the Triton kernels (``triton_kernels``) and CUDA graphs per bucketed shape (``graphs``).

May import: ``memory_core.errors``, ``weights``, ``block``, ``sets``, ``output``. Not the engine.
"""
