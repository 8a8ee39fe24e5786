"""A speculative-decoding draft from the same cache: an EAGLE-3 head trained from cached target features
(``training``), judged by speculative decoding with the target (``decoding``, ``drafters``, ``evaluation``), and
exported where vLLM, SGLang and speculators load it (``export``).

No front door: import each name from the module that defines it.
"""
