"""The draft family: what a speculative-decoding draft reads from a cache beside the hidden layers (the
``--layers draft`` preset).

* ``draft_layers`` (torch-free, so stage one's options read it on their light path): the preset's name and the
  low, middle and high layers an EAGLE-3 draft fuses.
* ``draft_inputs`` (torch): the cache's ``draft/`` folder, the target's input embedding ``[V, d]`` and token
  counts ``[V]``, which stage one writes and the draft reads.

No registry and no front door: import each name from the module that defines it.
"""
