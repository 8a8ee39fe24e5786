"""What the teacher's forward keeps: hooks on the selected layers (``features``, and ``qk_capture`` for queries and
keys), logits through the LM head in chunks (``logit_head``, and ``sharded_head`` for a head split across ranks),
and the device-to-host transfer that never makes the forward wait (``transfer``). The top floor of stage one's
sub-packages, above ``core``, ``rows`` and ``parallel``.

No front door: import each name from the module that defines it.
"""
