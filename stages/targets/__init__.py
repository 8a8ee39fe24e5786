"""The target families, one folder each: ``logits/`` (the ``--logits`` modes and stage two's vocabulary pass that
their loss terms run in) and ``attention/`` (the ``--attention-source`` sources, the q/k recording, the student's
maps and the attention loss terms), ``hidden/`` (the hidden codecs on the device and the ``--hidden-loss``
family) and ``draft/`` (what a draft reads beside the hidden layers: the ``--layers draft`` preset and the cache's
``draft/`` folder).

A floor of ``stages``: below ``precompute``, ``train`` and ``draft``, which import it, and above ``storage``; it
imports none of the stages. Each family is a registry package whose modules register one entry each: a torch-free
half that the registry, the option classes and ``kdcache inspect`` load, and a torch half loaded on first use
(docs/architecture.md, section 6).
"""
