"""Sparse dictionaries' tensors and their work inside one forward pass, below the driver contract.

Researchers reach ``SparseDictionary`` through ``tl_core.sae``; driver authors reach the
forward-pass pieces (``Attachment``, ``DictionaryRun``) through ``tl_core.driver_api``.
"""
